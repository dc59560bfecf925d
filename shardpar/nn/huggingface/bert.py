"""v1's `smdistributed.modelparallel.torch.nn.huggingface.bert`: identity translations (see the package)."""

from shardpar.nn.huggingface import identity_translation

translate_hf_state_dict_to_smdistributed_bert = identity_translation("to_smp", "bert")
translate_state_dict_to_hf_bert = identity_translation("to_hf", "bert")

__all__ = ["translate_hf_state_dict_to_smdistributed_bert", "translate_state_dict_to_hf_bert"]
