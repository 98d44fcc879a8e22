"""Engine deadlines (`--rollout-timeout`, `miles.ray.engine_wait`): an engine that reports its steps is waited for
however long the call takes, a silent one is named with its last report once one step's allowance is over, a total
deadline holds whatever the engine reports; the driver's display and the log see the steps."""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import time

import pytest
import ray
import torch

from miles.arguments.engine import EngineTimeouts, RolloutTimeout
from miles.models.conditioning import Conditioning
from miles.ray.engine_group import EngineActor, RolloutEngineGroup
from miles.rollout.engine_api import GenerateRequest, GenerateResult
from miles.rollout.micro_batches import EngineProgress
from miles.utils.failures import EngineError

# one step of 2 samples may take max(0.05 x 2, 1.0) = 1 s between two reports
TIMEOUTS = EngineTimeouts(startup_s=120, sync_s=120, rollout=RolloutTimeout(per_step_per_sample_s=0.05, floor_s=1.0))


class SteppingEngine(EngineActor):
    """An engine actor that loads nothing. Its request's first prompt says how a call behaves: "steady:S" takes S
    seconds per step and reports each; "silent:S" takes S seconds per step and reports none after its start."""

    def __init__(self, hf_checkpoint: str, **kwargs) -> None:
        self._progress, self.version = EngineProgress(), 0

    def generate(self, request: GenerateRequest) -> GenerateResult:
        mode, seconds = request.prompts[0].split(":")
        batch = len(request.prompts)
        self._report(phase="denoise", steps_done=0, steps_total=request.num_steps, micro_batches=1, samples=batch)
        for step in range(request.num_steps):
            time.sleep(float(seconds))
            if mode == "steady":
                self._report(steps_done=step + 1)
        self._report(phase="idle")
        zeros = torch.zeros(batch, 1)
        return GenerateResult(
            images=None,
            final_latents=zeros,
            latents=zeros[:, :0],
            next_latents=zeros[:, :0],
            log_probs=zeros[:, :0],
            sigmas=torch.zeros(request.num_steps + 1),
            trained_steps=[],
            conditioning=Conditioning({"embeds": zeros}),
            negative=None,
            weights_version=self.version,
        )


def request(behaviour: str, num_steps: int) -> GenerateRequest:
    return GenerateRequest(
        prompts=[behaviour] * 2,
        seeds=[0, 1],
        num_steps=num_steps,
        guidance_scale=1.0,
        negative_prompt="",
        sde_type="ode",
        noise_level=0.0,
        trained_steps=[],
    )


@pytest.fixture
def group(ray_cluster):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the workers cannot import this test file
    engines = RolloutEngineGroup(
        "unused", num_cpus_per_engine=0.1, timeouts=TIMEOUTS, engine_class=SteppingEngine, wait=True
    )
    engines.poll_s, engines.log_every_s = 0.05, 0.3
    yield engines
    engines.shutdown()


def test_a_slow_engine_that_reports_its_steps_is_waited_for_and_a_silent_one_is_named(group, caplog):
    caplog.set_level(logging.INFO, logger="miles.ray.engine_wait")
    shown = []
    group.on_progress = shown.append
    started = time.monotonic()
    result = group.generate(request("steady:0.2", num_steps=8), rollout_id=0)  # 1.6 s: past one step's 1 s
    assert result.batch_size == 2 and time.monotonic() - started >= 1.6
    assert any(re.fullmatch(r"generate [0-8]/8 steps", text) for text in shown) and shown[-1] == ""
    assert "generate of rollout 0: waited" in caplog.text and "engine 0: step" in caplog.text

    group.timeouts = dataclasses.replace(TIMEOUTS, rollout=RolloutTimeout(total_s=0.6))
    with pytest.raises(
        EngineError,
        match=r"engine 0 of 1 did not answer generate of rollout 1 within 0\.\ds \(last report: step \d/8\); --rollout-timeout total:0.6",
    ):
        group.generate(request("steady:0.2", num_steps=8), rollout_id=1)  # reports or not: 0.6 s in all

    group.timeouts = TIMEOUTS
    started = time.monotonic()
    late = (
        r"engine 0 of 1 made no progress for [\d.]+s during generate of rollout 2 \(last report: step 0/2; 1s allowed"
    )
    with pytest.raises(EngineError, match=late) as failure:
        group.generate(request("silent:1.0", num_steps=2), rollout_id=2)
    # it first finished the steady call (its reports kept this wait going), then fell silent for one allowance
    assert 1.0 <= time.monotonic() - started < 4.0 and failure.value.index == 0 and group.failed
