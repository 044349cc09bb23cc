"""KernelConfig: the kernels' routes and numerics are an engine's configuration, resolved at
start-up against the machine, applied before each of its steps, so two engines in one process
may differ; a configuration the machine cannot run is a clear error."""
import dataclasses

import pytest

from kvserve import ops
from kvserve.config import ConfigError, EngineArgs, KernelConfig, parse_kernel_config
from kvserve.cpu_features import has_feature
from kvserve.request import SamplingParams

NATIVE = pytest.mark.skipif(ops.load_extension() is None, reason="fused kernels unavailable")


def test_parsing_names_what_is_wrong():
    assert parse_kernel_config(None) == KernelConfig()
    assert parse_kernel_config({"step_teams": False}).step_teams is False
    with pytest.raises(ConfigError, match="unknown kernel_config key.*bf16"):
        parse_kernel_config({"bf16": "dot"})
    with pytest.raises(ConfigError, match="unknown attention_route 'fast'"):
        parse_kernel_config({"attention_route": "fast"})
    with pytest.raises(ConfigError, match="kernel_config must be"):
        EngineArgs(kernel_config="dot").validate()
    args = EngineArgs(kernel_config={"batch_invariant": False})
    args.validate()
    assert args.kernel_config == KernelConfig(batch_invariant=False)


def test_describe_is_the_start_up_line():
    assert KernelConfig(native_kernels=False).describe() == "kernels: plain torch"
    text = KernelConfig(step_teams=False).describe()
    assert "step teams off" in text and "batch-invariant on" in text


@NATIVE
def test_two_engines_in_one_process_keep_their_own_kernels(llm_factory):
    native = llm_factory(model="tiny-llama", num_blocks=64)
    plain = llm_factory(model="tiny-llama", num_blocks=64, kernel_config=KernelConfig(native_kernels=False))
    no_teams = llm_factory(model="tiny-llama", num_blocks=64, kernel_config=KernelConfig(step_teams=False))
    resolved = native.engine.kernel_config
    assert resolved.native_kernels and resolved.bf16_route != "auto" and resolved.attention_route != "auto"
    assert plain.engine.kernel_config.native_kernels is False
    params = SamplingParams(temperature=0.0, max_tokens=6)
    outputs = {}
    for name, llm in (("native", native), ("plain", plain), ("no_teams", no_teams), ("native again", native)):
        outputs[name] = llm.generate(["The capital of France is"], params)[0].outputs[0].token_ids
        # Each engine's step put its own configuration in force.
        assert ops.batch_invariant() is llm.engine.kernel_config.batch_invariant
        assert (ops.load_extension() is not None) == llm.engine.kernel_config.native_kernels
        if llm.engine.kernel_config.native_kernels:
            assert ops.load_extension().step_teams_enabled() == llm.engine.kernel_config.step_teams
    assert outputs["native"] == outputs["native again"] == outputs["no_teams"]
    assert len(outputs["plain"]) == 6


@NATIVE
def test_a_route_the_machine_cannot_run_is_refused():
    if has_feature("amx_bf16"):
        pytest.skip("this CPU may run the tiles")
    with pytest.raises(ConfigError, match="amx"):
        ops.apply_kernel_config(KernelConfig(bf16_route="amx"))
    with pytest.raises(ConfigError, match="amx"):
        ops.apply_kernel_config(KernelConfig(attention_route="amx"))
    ops.apply_kernel_config(KernelConfig())  # the defaults back in force for the tests after
    assert ops.batch_invariant()


@NATIVE
def test_another_march_cannot_replace_this_process_build():
    ops.apply_kernel_config(KernelConfig())
    with pytest.raises(ConfigError, match="cpu_march"):
        ops.apply_kernel_config(dataclasses.replace(KernelConfig(), cpu_march="x86-64-v2"))
    ops.apply_kernel_config(KernelConfig())
