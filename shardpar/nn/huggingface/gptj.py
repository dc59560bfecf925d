"""v1's `smdistributed.modelparallel.torch.nn.huggingface.gptj`: identity translations (see the package)."""

from shardpar.nn.huggingface import identity_translation

translate_hf_state_dict_to_smdistributed_gptj = identity_translation("to_smp", "gptj")
translate_state_dict_to_hf_gptj = identity_translation("to_hf", "gptj")

__all__ = ["translate_hf_state_dict_to_smdistributed_gptj", "translate_state_dict_to_hf_gptj"]
