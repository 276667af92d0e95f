"""core_v0.19's GPT model builder with RoPE at each token's true position (``rotary.py``).

From core_v0.19 pretrain_gpt.py no longer calls a model provider: ``setup_model_and_optimizer``
builds every model chunk with the builder its ``GPTModelConfig`` names. Under HDP
(``pretrain_hooks.model_config``) the config names this subclass, which builds with Megatron's
own builder and then swaps the chunk's RoPE table for the true-position one, as the core_v0.16
model provider does after ``gpt_builder``. Imported only by that name, on core_v0.19.
"""

from __future__ import annotations

from megatron.training.models.gpt import GPTModelBuilder

from .rotary import use_true_positions


class HDPGPTModelBuilder(GPTModelBuilder):
    def build_model(self, pg_collection, pre_process=None, post_process=None, vp_stage=None):
        model = super().build_model(
            pg_collection, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
        if self._model_config.position_embedding_type == "rope":  # learned positions read position_ids directly
            use_true_positions(model)
        return model
