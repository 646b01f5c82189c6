"""A very short `phoenixft bench serve --open-loop`: three systems (the server with the
recovery log, the server with --no-recovery, transformers' generate) complete every
request at a Poisson rate and in a burst, in float32 and bfloat16, and the report has
vLLM's figures; never how fast anything was."""

import argparse
import json

import pytest

from phoenixft.bench import serve, serve_open

pytestmark = pytest.mark.integration


@pytest.mark.timeout(400)
def test_serve_open_loop_smoke(tmp_path):
    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    out = tmp_path / "open.json"
    args = parser.parse_args(["serve", "--open-loop", "--size", "tiny", "--requests", "4",
                              "--rates", "4", "--max-model-len", "256", "--length-scale", "0.05",
                              "--out", str(out)])
    assert args.func(args) == 0
    r = json.loads(out.read_text())
    assert r["bench"] == "serve-open" and r["rates"] == ["4/s", "burst"]
    for dt in ("float32", "bfloat16"):
        for system in ("engine", "engine_no_log", "transformers"):
            for rate in ("4/s", "burst"):
                m = r["results"][dt][system][rate]
                assert (m["completed"], m["errors"]) == (4, 0), (dt, system, rate, m)
                assert m["output_tokens"] > 0 and m["ttft_ms"]["p99"] >= m["ttft_ms"]["p50"] > 0
                assert m["tpot_ms"]["p50"] is None or m["tpot_ms"]["p50"] > 0
    mem = r["memory"]
    assert mem["float32"]["kv_bytes_per_token"] == 2 * mem["bfloat16"]["kv_bytes_per_token"]
    assert mem["bfloat16"]["sequences_at_context"] == 2 * mem["float32"]["sequences_at_context"]
    assert "AzurePublicDataset" in r["lengths_source"]
    names = [g["name"] for g in r["goals"]]
    assert sum("recovery log on over off" in n for n in names) == 2
    assert any(n.startswith("bfloat16 engine over float32") for n in names)
    assert serve_open.headline(r).startswith("open loop, tiny model")
    assert "| dtype | system |" in "\n".join(serve_open.markdown(r))


def test_lengths_are_drawn_from_the_trace_and_fit_the_model():
    import random

    hist = serve_open.load_lengths()
    assert hist["rows"] == 19366 and sum(hist["joint_counts"].values()) <= hist["rows"]
    reqs, redrawn = serve_open.draw_requests(200, random.Random(0), 0.25, 512, 256, hist)
    assert len(reqs) == 200 and all(len(p) + o <= 512 for p, o in reqs)
    full, _ = serve_open.draw_requests(400, random.Random(1), 1.0, 10**6, 256, hist)
    med = sorted(len(p) for p, _ in full)[200]
    assert 500 < med < 2000  # the trace's median context is 1,020 tokens
    assert serve_open.arrivals(3, float("inf"), random.Random(0)) == [0.0, 0.0, 0.0]
    gaps = serve_open.arrivals(2000, 4.0, random.Random(0))
    assert abs(gaps[-1] / 1999 - 0.25) < 0.03  # Poisson at 4/s: mean gap 0.25 s
