"""FSDPEngine on a vision-language model, run for real under torchrun on gloo (1 and 2 ranks).

The checks live in tests/scripts/vlm_worker.py: packed = padded with images (log-probabilities
and the gradient of one SGD step against HF's own padded forward and backward), invariance to
micro-batches and ranks (also when one rank's share has no image), the vision tower frozen by
``freeze_vision_tower``, HF saves and weight updates. Marked ``vlm`` (``make test-vlm``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_fsdp import torchrun

from areal_lite.utils.tiny_vlm import build_tiny_vlm

pytestmark = pytest.mark.vlm
WORKER = Path(__file__).parent / "scripts" / "vlm_worker.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return build_tiny_vlm(str(tmp_path_factory.mktemp("vlm_fsdp") / "model"), seed=2)


def run_worker(world: int, model_dir: str, out: Path) -> tuple[dict, Path]:
    code, output = torchrun(world, WORKER, model_dir, str(out), timeout=400)
    assert code == 0, output[-6000:]
    with open(out / f"vlm_w{world}.json") as f:
        return json.load(f), out


@pytest.fixture(scope="module")
def single(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    return run_worker(1, model_dir, tmp_path_factory.mktemp("vlm_w1"))


@pytest.fixture(scope="module")
def pair(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    return run_worker(2, model_dir, tmp_path_factory.mktemp("vlm_w2"))


@pytest.fixture(params=["single", "pair"])
def run(request: pytest.FixtureRequest) -> tuple[dict, Path]:
    return request.getfixturevalue(request.param)


def test_the_batch_mixes_one_two_and_no_images(run: tuple[dict, Path]) -> None:
    assert run[0]["images_per_row"] == [1, 2, 0, 1, 0, 1, 1, 0]


def test_packed_logprobs_with_images_equal_hf_padded_forward(run: tuple[dict, Path]) -> None:
    res = run[0]
    for attn in ("sdpa", "eager"):
        assert res[f"logprob_err_{attn}"] < 1e-5, attn
        assert res[f"entropy_err_{attn}"] < 1e-5, attn
    assert res["logprob_err_uneven"] < 1e-5  # with 2 ranks, one rank's share has no image
    # A placeholder the model generated is a text token: HF's forward given the embeddings
    # (itself equal to HF's own padded forward on the batch without one).
    assert res["embeds_ref_err"] < 1e-5
    assert res["logprob_err_generated_placeholder"] < 1e-5


def test_gradient_with_images_equals_hf_padded_backward(run: tuple[dict, Path]) -> None:
    """One SGD step (lr 1, no clipping): the engine's parameters equal HF's parameters minus HF's
    gradient of the padded batch, vision tower included, whatever the micro-batches and ranks."""
    res = run[0]
    assert res["hf_vision_grad_norm"] > 1e-3  # the tower is trained through the image tokens
    for tag in ("mb1", "mb4", "uneven"):
        assert res[f"changed_{tag}"] > 1e-2, tag
        assert res[f"grad_err_{tag}"] < 1e-6, tag
        assert res[f"stats_{tag}"]["loss"] == pytest.approx(res["stats_mb1"]["loss"], abs=1e-5)


def test_same_parameters_on_one_rank_and_two(single: tuple[dict, Path], pair: tuple[dict, Path]) -> None:
    ref = torch.load(single[1] / "params_mb1_w1.pt")
    for out, tag, world in ((single[1], "mb4", 1), (pair[1], "mb1", 2), (pair[1], "mb4", 2), (pair[1], "uneven", 2)):
        other = torch.load(out / f"params_{tag}_w{world}.pt")
        assert ref.keys() == other.keys()
        assert max(float((ref[k] - other[k]).abs().max()) for k in ref) < 1e-6, (tag, world)


def test_freeze_vision_tower_trains_the_decoder_only(run: tuple[dict, Path]) -> None:
    res = run[0]
    assert res["frozen_trainable"] == ["lm_head.weight", "model.language_model"]
    assert res["frozen_vision_change"] == 0.0
    assert res["frozen_decoder_change"] > 1e-2
    assert res["frozen_decoder_err"] < 1e-6  # the decoder's gradient is unchanged by the freeze


def test_saves_and_weight_updates_carry_the_whole_model(run: tuple[dict, Path]) -> None:
    res = run[0]
    assert res["saved_err"] == 0.0 and res["saved_processor"] == "Qwen2_5_VLProcessor"
    for kind, version in (("in_process", 1), ("disk", 2), ("distributed", 3)):
        assert res[f"update_{kind}_diff"] == 0.0, kind
        assert res[f"update_{kind}_version"] == version, kind


def test_megatron_names_what_it_does_not_support(model_dir: str) -> None:
    from areal_lite.api.config import TrainEngineConfig
    from areal_lite.engines.train.megatron import MegatronEngine

    engine = MegatronEngine(TrainEngineConfig(path=model_dir, backend="megatron"))
    with pytest.raises(NotImplementedError, match="vision-language models.*backend=fsdp"):
        engine.initialize()


def test_vision_demo_runs_end_to_end(tmp_path: Path) -> None:
    """`make demo-vlm`'s script, cut short: SFT warm-up and GRPO steps with the pictures through the
    embedded engine and the trainer, a HF checkpoint that loads with its processor, a RESULT line.
    Needs the embedded engine's image support (the serving half)."""
    from test_examples import QUIET, final_checkpoint, run

    from areal_lite.utils.vision import load_processor

    out = run(
        "vision_grpo.py", "vision_grpo.yaml", f"cluster.fileroot={tmp_path}", "task.sft_steps=4",
        "task.sft_eval_every=2", "task.n_dev=8", "task.n_eval=8", "task.n_train_prompts=64", "total_train_steps=2",
        "train_dataset.batch_size=4", "actor.ppo_n_minibatches=2", "saver.freq_steps=2", *QUIET, launcher=True,
        timeout=600,
    )  # fmt: skip
    assert "held-out greedy accuracy after SFT" in out
    checkpoint = final_checkpoint(tmp_path / "vision-grpo" / "demo", 2)
    assert checkpoint.exists()
    assert type(load_processor(str(checkpoint.parent))).__name__ == "Qwen2_5_VLProcessor"
