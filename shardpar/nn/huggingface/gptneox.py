"""v1's `smdistributed.modelparallel.torch.nn.huggingface.gptneox`: identity translations (see the package)."""

from shardpar.nn.huggingface import identity_translation

translate_hf_state_dict_to_smdistributed_gptneox = identity_translation("to_smp", "gptneox")
translate_state_dict_to_hf_gptneox = identity_translation("to_hf", "gptneox")

__all__ = ["translate_hf_state_dict_to_smdistributed_gptneox", "translate_state_dict_to_hf_gptneox"]
