"""sweeps/checkpointing.py on the CPU: trial validation, one trial's metrics, the best-k neighbours, the report,
and the script end to end (local launcher, offload study)."""

import math

import pandas as pd
import pytest
import torch

from raysys.results.records import trial_id

from sweeps import checkpointing as sweep

TINY = dict(study="segments", size="tiny", num_layers=4, context_length=32, batch_size=2, warmup=1, steps=2,
            device="cpu")


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_trial_validation():
    for bad, match in ((dict(study="x"), "study"), (dict(size="huge"), "size"), (dict(dtype="int8"), "dtype"),
                       (dict(policy="full*3"), "add up|entries"), (dict(steps=0), "steps"),
                       (dict(attention="bogus"), "attention backend .bogus. is not one of")):
        with pytest.raises(ValueError, match=match):
            sweep.Trial(**{**TINY, "policy": "none", **bad})


def test_run_trial_metrics_match_the_model():
    none = sweep.run_trial({**TINY, "policy": "none"})
    full = sweep.run_trial({**TINY, "policy": "full:2"})
    assert full["segment_k"] == 2 and math.isnan(none["segment_k"])
    assert full["peak_bytes"] < none["peak_bytes"]
    assert full["recompute_flops"] > 0 == none["recompute_flops"]
    for m in (none, full):
        assert abs(m["predicted_rel_error"]) < 0.05
        assert m["step_mean_s"] > 0 and m["memory_method"].startswith("cpu")


def test_grid_and_neighbours_of_best():
    cpu = torch.device("cpu")
    seg = sweep.grid("segments", cpu, True, "fp32", 2, 5)
    assert [t["policy"] for t in seg] == ["none", "selective", "nested", "sqrt", "full:1", "full:2", "full:4",
                                          "full:8", "selective"]
    assert [t.get("attention", "naive") for t in seg] == ["naive"] * 8 + ["sdpa"]  # the fused core: sdpa on CPU
    assert {t["size"] for t in seg} == {"tiny"} and all(sweep.Trial(**t) for t in seg)
    assert len({trial_id(t) for t in seg}) == len(seg)
    assert len(sweep.grid("context", cpu, True, "fp32", 2, 5)) == 12
    gpu = sweep.grid("segments", torch.device("cuda"), False, "fp32", 2, 5)
    assert gpu[0]["size"] == "xl" and gpu[-2]["policy"] == "full:32" and gpu[-1]["attention"] == "flash_triton"
    # the neighbours of the best k: only the asked-for policies, no second fused trial
    assert [t["policy"] for t in sweep.grid("segments", cpu, True, "fp32", 2, 5, policies=["full:3"])] == ["full:3"]
    df = pd.DataFrame({"study": "segments", "status": ["ok", "ok", "ok", "oom"], "segment_k": [1, 2, 8, 32],
                       "peak_bytes": [5.0, 4.0, 6.0, float("nan")]})
    assert sweep.neighbours_of_best(df, 32) == [3]


def test_summarize_answers_the_questions():
    gib = 2**30
    rows = [dict(study="context", size="m", context_length=4096, batch_size=1, policy=p, status="ok", device="cuda",
                 segment_k=float("nan"), step_mean_s=t, peak_bytes=pk * gib, between_steps_bytes=10 * gib,
                 activation_peak_bytes=(pk - 10) * gib, predicted_peak_bytes=pk * gib * 1.05,
                 predicted_rel_error=0.05)
            for p, t, pk in (("none", 1.0, 60), ("selective", 1.04, 20), ("full", 1.3, 12))]
    rows.append({**rows[1], "attention": "flash_triton", "step_mean_s": 0.8, "peak_bytes": 12 * gib,
                 "activation_peak_bytes": 2 * gib})
    text = sweep.summarize(pd.DataFrame(rows))
    assert ("selective (attention core recomputed by torch's selective checkpointing) keeps 5.00x less activation "
            "memory than none (naive attention) at +4.0% step time (target >= 4x at <= 5%: met)") in text
    assert ("selective (attention core recomputed inside the fused `flash_triton` backward (keeps O and L)) keeps "
            "25.00x less activation memory than none (naive attention) at -20.0% step time") in text
    assert "| selective (flash_triton) |" in text
    assert "within 10% of measured on 4 of 4" in text
    # an OOM row gets the model's prediction at report time (no device needed)
    oom = pd.DataFrame(rows + [dict(study="segments", size="tiny", num_layers=4, context_length=32, batch_size=2,
                                    policy="none", dtype="fp32", device="cpu", warmup=1, steps=2, status="oom",
                                    predicted_peak_bytes=float("nan"))])
    filled = sweep.with_predictions(oom)
    expected = sweep.run_trial(dict(TINY, policy="none"))["predicted_peak_bytes"]
    assert filled.predicted_peak_bytes.iloc[-1] == pytest.approx(expected)
    assert "out of memory, as predicted: segments tiny S=32 none (" in sweep.summarize(filled)
    # offload against recomputation: 2 GiB per block moved out and back vs 0.1 s / 4 blocks recomputed
    off = [dict(rows[0], study="offload", policy=p, num_layers=4, step_mean_s=t, h2d_GBps=h, d2h_GBps=h,
                saved_per_block_none_bytes=gib) for p, t, h in (("none", 1.0, float("nan")),
                                                                ("full", 1.1, float("nan")), ("offload", 1.2, 50.0))]
    text = sweep.summarize(pd.DataFrame(rows + off))
    assert ("per block: recompute 25.0 ms, offload 50.0 ms extra; moving 2.00 GiB per block breaks even with "
            "recomputation at 86 GB/s") in text


def test_script_writes_parquet_and_report(tmp_path):
    df = sweep.main(["--quick", "--device", "cpu", "--study", "offload", "--out", str(tmp_path)])
    assert (tmp_path / "checkpointing.parquet").exists() and (tmp_path / "checkpointing.md").exists()
    assert list(df.policy) == ["none", "full", "offload:0"] and set(df.status) == {"ok"}
    assert df.loc[df.policy == "offload:0", "offloaded_bytes_per_step"].iloc[0] > 0
    again = sweep.main(["--quick", "--device", "cpu", "--study", "offload", "--out", str(tmp_path), "--resume"])
    assert list(again.trial_id) == list(df.trial_id)  # resumed: nothing re-run, nothing duplicated


def test_tune_launch_splits_trials_into_grids_per_attention_backend(tmp_path, monkeypatch):
    """The context study varies context x policy for naive attention plus one fused-core trial per context:
    no single two-axis grid, so each backend gets its own Tune run (each a full grid)."""
    import raysys.cluster.sweep
    from raysys.results.records import ResultWriter

    calls = []
    monkeypatch.setattr(raysys.cluster.sweep, "tune_run", lambda trainable, space, **kw: calls.append(space))
    trials = sweep.grid("context", torch.device("cpu"), True, "fp32", 2, 5)
    sweep.run_tune(trials, ResultWriter(tmp_path, sweep.SWEEP), gpus=0)
    assert len(calls) == 2
    naive, fused = calls
    assert naive["context_length"].get("grid_search") == [32, 64, 128] and \
        naive["policy"].get("grid_search") == ["none", "selective", "full"] and "attention" not in naive
    assert fused["attention"] == "sdpa" and fused["policy"] == "selective"
    with pytest.raises(ValueError, match="full grid of at most two axes"):
        sweep.run_tune([dict(t, warmup=i) for i, t in enumerate(trials[:9])], ResultWriter(tmp_path, "x"), gpus=0)
