"""v1's `smdistributed.modelparallel.torch.nn.huggingface.llama`: identity translations (see the package)."""

from shardpar.nn.huggingface import identity_translation

translate_hf_state_dict_to_smdistributed_llama = identity_translation("to_smp", "llama")
translate_state_dict_to_hf_llama = identity_translation("to_hf", "llama")

__all__ = ["translate_hf_state_dict_to_smdistributed_llama", "translate_state_dict_to_hf_llama"]
