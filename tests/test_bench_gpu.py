"""scripts/bench/gpu.py on CPU: its smoke shape runs every row that can run here, and its FLOPs
count agrees with the model's parameter count."""

import json

import pytest



def _bench():
    from scripts.bench import gpu as bench_gpu

    return bench_gpu


def test_matmul_parameters_are_the_models_without_embedding_and_norms():
    from hetjax.layers import ModelConfig

    bench = _bench()
    s = bench.Shape()  # TinyLlama-1.1B
    m = ModelConfig(vocab_size=s.vocab, d_model=s.d_model, n_layers=s.n_layers,
                    n_heads=s.n_heads, n_kv_heads=s.n_kv_heads, d_ff=s.d_ff,
                    tie_embeddings=False)
    norms = (2 * s.n_layers + 1) * s.d_model
    assert s.matmul_params == m.num_params - m.embed_params - norms
    assert 1.03e9 < s.matmul_params < 1.04e9  # TinyLlama: 1.10e9 with the embedding


@pytest.mark.slow  # ~35 s of CPU: two models compiled and stepped
def test_smoke_run_prints_the_table_and_writes_json(tmp_path, capsys):
    bench = _bench()
    out = tmp_path / "bench.json"
    bench.main(["--smoke", "--steps", "1", "--warmup", "1", "--out", str(out),
                "--rows", "trainer,trainer-moe,jit-xla,jit-fused,hf-eager"])
    result = json.loads(out.read_text())
    rows = {r["row"]: r["result"] for r in result["rows"]}
    assert result["platform"] == "cpu" and result["shape"]["d_model"] == 64
    for row in ("trainer", "trainer-moe", "jit-xla"):
        assert rows[row]["step_s"] > 0 and rows[row]["loss"] > 0, rows[row]
        assert rows[row]["attention"].startswith("xla")
    assert rows["jit-fused"]["skipped"].startswith("no fused kernel here")
    assert "step_s" in rows["hf-eager"] or "skipped" in rows["hf-eager"]  # torch may be absent
    assert result["prediction"]["step_s"] > 0
    text = capsys.readouterr().out
    assert "| hetjax Trainer | xla (auto on cpu) |" in text
    assert "hetjax plan predicts for the Trainer row: step" in text
