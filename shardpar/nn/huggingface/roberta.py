"""v1's `smdistributed.modelparallel.torch.nn.huggingface.roberta`: identity translations (see the package)."""

from shardpar.nn.huggingface import identity_translation

translate_hf_state_dict_to_smdistributed_roberta = identity_translation("to_smp", "roberta")
translate_state_dict_to_hf_roberta = identity_translation("to_hf", "roberta")

__all__ = ["translate_hf_state_dict_to_smdistributed_roberta", "translate_state_dict_to_hf_roberta"]
