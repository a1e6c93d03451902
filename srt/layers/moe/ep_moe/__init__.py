"""Expert-parallel MoE (SGLang's `ep_moe`): srt has none; `layer.get_moe_impl_class` names the
one expert layer it has."""
