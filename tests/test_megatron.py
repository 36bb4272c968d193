"""MegatronEngine acceptance: the same tiny model and batch through FSDPEngine and MegatronEngine
with TP=2, TP=1 x DP=2 and PP=2, all under one torchrun launch of 2 gloo ranks
(tests/scripts/megatron_worker.py), compared here: log-probabilities, entropies, loss and the
parameters after one `train_batch` equal to 1e-5; the Megatron-saved HF directory loads with
``from_pretrained`` and gives the engine's log-probabilities (also for tied embeddings at TP=2 and
PP=2); a critic equals FSDP's critic; weight updates of all three kinds deliver the same tensors; a non-finite step is skipped; a
``train_state`` checkpoint resumes exactly; forward_backward calls then optim_step equal one
train_batch on the union of their batches (SGD), and optim_step's explicit arguments are used. The vocabulary (301) is odd, so TP=2 exercises the padded
vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_fsdp import torchrun
from transformers import AutoModelForCausalLM

from areal_lite.api.config import TrainEngineConfig
from areal_lite.api.io import SaveLoadMeta
from areal_lite.kit import make_train_engine
from areal_lite.utils.tiny import build_tiny_model

WORKER = Path(__file__).parent / "scripts" / "megatron_worker.py"
RUNS = ("fsdp", "mcore_tp2", "mcore_tp1", "mcore_pp2")
MEGATRON_RUNS = RUNS[1:]
TOL = 1e-5


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_tiny_model(str(tmp_path_factory.mktemp("mcore_model")), hidden_size=32, num_layers=2, vocab_size=301)
    out = tmp_path_factory.mktemp("mcore_out")
    code, output = torchrun(2, WORKER, model, str(out), timeout=400)
    assert code == 0, output[-6000:]
    (out / "model").write_text(model)
    return out


def results(out: Path) -> dict[str, dict]:
    return {run: torch.load(out / f"{run}.pt") for run in RUNS}


def safetensors_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_same_engine_types_as_configured(out: Path) -> None:
    r = results(out)
    assert [r[run]["type"] for run in RUNS] == ["FSDPEngine"] + ["MegatronEngine"] * len(MEGATRON_RUNS)


def test_logprobs_entropy_and_loss_equal_fsdp(out: Path) -> None:
    r = results(out)
    ref = r["fsdp"]
    assert ref["lp"].shape == (8, 24)
    for run in MEGATRON_RUNS:
        assert torch.allclose(r[run]["lp"], ref["lp"], rtol=0, atol=TOL), run
        assert torch.allclose(r[run]["ent"], ref["ent"], rtol=0, atol=TOL), run
        assert r[run]["lp"][:, 0].abs().max() == 0
        for key in ("loss", "entropy", "grad_norm", "lr"):
            assert abs(r[run]["stats"][key] - ref["stats"][key]) < TOL, (run, key)
        assert r[run]["stats"]["update_successful"] == 1.0
        for key in ("loss", "entropy"):
            # eval_batch ran before the update, on the same data
            assert abs(r[run]["eval_stats"][key] - ref["stats"][key]) < TOL, (run, key)
    assert abs(ref["eval_stats"]["loss"] - ref["stats"]["loss"]) < TOL


def test_frozen_engine_gives_the_same_logprobs(out: Path) -> None:
    assert json.loads((out / "checks.json").read_text())["frozen_lp_err"] < TOL


def test_parameters_after_one_step_equal_fsdp(out: Path) -> None:
    initial = safetensors_dir(Path((out / "model").read_text()))
    ref = safetensors_dir(out / "fsdp_hf")
    for run in MEGATRON_RUNS:
        assert max_diff(safetensors_dir(out / f"{run}_hf"), ref) < TOL, run
    # every tensor moved by more than the tolerance (most by far more), so the comparison has teeth
    moved = [float((ref[k] - initial[k]).abs().max()) for k in ref]
    assert min(moved) > TOL and max(moved) > 100 * TOL
    r = results(out)
    for run in MEGATRON_RUNS:
        assert torch.allclose(r[run]["lp_after"], r["fsdp"]["lp_after"], rtol=0, atol=TOL), run


def test_megatron_hf_checkpoint_loads_with_from_pretrained(out: Path) -> None:
    r = results(out)["mcore_tp2"]
    batch = r["batch"]
    model = AutoModelForCausalLM.from_pretrained(str(out / "mcore_tp2_hf"))
    ids, am = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am.long()).logits.float()
    lp = torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    lp = torch.cat([torch.zeros(ids.shape[0], 1), lp], 1) * am
    assert torch.allclose(lp, r["lp_after"], rtol=0, atol=TOL)
    assert model.config.vocab_size == 301


@pytest.mark.parametrize("layout", ["tp2", "pp2"])
def test_tied_embeddings_train_and_save_consistently(out: Path, layout: str) -> None:
    checks = json.loads((out / "checks.json").read_text())
    assert checks[f"tied_{layout}_initial_err"] < TOL
    assert checks[f"tied_{layout}_saved_err"] < TOL
    assert checks[f"tied_{layout}_moved"] > 100 * TOL


def test_critic_equals_fsdp_critic(out: Path) -> None:
    ref = torch.load(out / "critic_fsdp.pt")
    ref_params = safetensors_dir(out / "critic_fsdp_hf")
    assert "score.weight" in ref_params and "lm_head.weight" not in ref_params
    assert (ref["after"] - ref["before"]).abs().max() > 100 * TOL
    for run in ("tp2", "pp2"):
        r = torch.load(out / f"critic_{run}.pt")
        assert torch.allclose(r["before"], ref["before"], rtol=0, atol=TOL), run
        assert torch.allclose(r["after"], ref["after"], rtol=0, atol=TOL), run
        assert abs(r["stats"]["loss"] - ref["stats"]["loss"]) < TOL, run
        assert max_diff(safetensors_dir(out / f"critic_{run}_hf"), ref_params) < TOL, run


def test_weight_updates_deliver_the_saved_weights(out: Path) -> None:
    checks = json.loads((out / "checks.json").read_text())
    assert checks["update_names_match"] is True
    for kind in ("in_process", "disk", "distributed"):
        assert checks[f"update_{kind}_err"] == 0.0, kind


def test_non_finite_gradient_skips_the_step(out: Path) -> None:
    checks = json.loads((out / "checks.json").read_text())
    assert checks["nan_update_successful"] == 0.0
    assert checks["nan_changed"] == 0.0


def test_train_state_checkpoint_resumes_exactly(out: Path) -> None:
    checks = json.loads((out / "checks.json").read_text())
    uninterrupted, resumed = checks["resume_stats"]
    assert uninterrupted == resumed
    assert max_diff(safetensors_dir(out / "tp2_step2_hf"), safetensors_dir(out / "tp2_resumed_hf")) == 0.0


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_forward_backward_calls_then_optim_step_equal_one_train_batch(out: Path, layout: str) -> None:
    """Three forward_backward calls (each loss scaled by its batch's share of the union's loss
    weight) then optim_step: the SGD update of one train_batch on the union."""
    res = json.loads((out / "checks.json").read_text())[f"accum_{layout}"]
    assert res["changed"] > 1e-2
    assert res["param_err"] < 1e-6
    assert res["loss"][0] == pytest.approx(res["loss"][1], rel=1e-6)
    assert res["grad_norm"][0] == pytest.approx(res["grad_norm"][1], rel=1e-6)


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_forward_backward_logprobs_returns_forwards_logprobs(out: Path, layout: str) -> None:
    res = json.loads((out / "checks.json").read_text())[f"one_pass_{layout}"]
    assert res["logprob_err"] < 1e-5
    assert res["loss"][0] == pytest.approx(res["loss"][1], rel=1e-6)


def test_optim_step_uses_explicit_lr_weight_decay_and_max_grad_norm(out: Path) -> None:
    res = json.loads((out / "checks.json").read_text())["override"]
    stats = res["stats"]
    assert stats["lr"] == 0.25 != res["configured_lr"] and stats["update_successful"] == 1.0
    norm = stats["grad_norm"]
    assert norm > 0.1  # clipped to 0.01, far from the configured 1.0
    # SGD moves by lr x the gradient clipped to max_grad_norm (megatron adds 1e-6 to the norm)
    assert res["step_norm"] == pytest.approx(0.25 * 0.01 * norm / (norm + 1e-6), rel=1e-5)
    assert res["lr_after"] == res["configured_lr"]  # the schedule's LR is back for the next step
    assert res["wd_err"] < 1e-7  # decayed by exactly 1 - lr x wd, 1-D tensors not at all


def test_backend_line_picks_the_engine() -> None:
    assert type(make_train_engine(TrainEngineConfig(path="x", backend="megatron"))).__name__ == "MegatronEngine"
    assert type(make_train_engine(TrainEngineConfig(path="x", backend="fsdp"))).__name__ == "FSDPEngine"
    with pytest.raises(ValueError, match="fsdp or megatron"):
        make_train_engine(TrainEngineConfig(path="x", backend="deepspeed"))
    for key in ("liger_kernels", "compile_layers"):  # the FSDP engine's model options, not silently ignored
        with pytest.raises(ValueError, match=f"{key}: the FSDP engine's"):
            make_train_engine(TrainEngineConfig(path="x", backend="megatron", **{key: True}))


def test_checkpoint_formats_are_named_and_checked(tmp_path: Path) -> None:
    """An unknown weight_format (the old name ``dcp`` too) is refused by name; a train_state
    directory that another backend wrote (here FSDP's files) is refused before anything is read."""
    with pytest.raises(ValueError, match="'dcp' is called 'train_state'"):
        SaveLoadMeta(path=str(tmp_path), weight_format="dcp")  # type: ignore[arg-type]
    engine = make_train_engine(TrainEngineConfig(path="x", backend="megatron"))
    meta = SaveLoadMeta(path=str(tmp_path))
    meta.weight_format = "safetensors"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="must be one of hf, peft, train_state"):
        engine.save(meta)
    (tmp_path / "extra_state_rank0.pt").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no MegatronEngine training state"):
        engine.load(SaveLoadMeta(path=str(tmp_path), weight_format="train_state"))
