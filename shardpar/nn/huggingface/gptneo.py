"""v1's `smdistributed.modelparallel.torch.nn.huggingface.gptneo`: identity translations (see the package)."""

from shardpar.nn.huggingface import identity_translation

translate_hf_state_dict_to_smdistributed_gptneo = identity_translation("to_smp", "gptneo")
translate_state_dict_to_hf_gptneo = identity_translation("to_hf", "gptneo")

__all__ = ["translate_hf_state_dict_to_smdistributed_gptneo", "translate_state_dict_to_hf_gptneo"]
