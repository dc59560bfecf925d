"""v1's `smdistributed.modelparallel.torch.nn.huggingface.gpt2`: identity translations (see the package)."""

from shardpar.nn.huggingface import identity_translation

translate_hf_state_dict_to_smdistributed_gpt2 = identity_translation("to_smp", "gpt2")
translate_state_dict_to_hf_gpt2 = identity_translation("to_hf", "gpt2")

__all__ = ["translate_hf_state_dict_to_smdistributed_gpt2", "translate_state_dict_to_hf_gpt2"]
