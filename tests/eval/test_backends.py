"""The report's comparison with llama.cpp's ar (pipeline/eval/backends.py) on hand-made rows."""

from pipeline.eval.backends import markdown, versus_llamacpp_ar


def row(target, backend, variant, rid, wall, decode, digest="d"):
    return {"target": target, "backend": backend, "benchmark": "b", "request_id": rid, "method": variant.split("@")[0],
            "variant": variant, "wall_s": wall, "decode_s": decode, "token_digest": digest}


def test_every_variant_is_compared_with_llamacpp_ar_on_the_same_requests():
    rows = [row("l", "llamacpp", "ar", i, 10.0, 4.0) for i in ("1", "2")]
    rows += [row("l", "llamacpp", "ooo@adaptive", i, 8.0, 2.0) for i in ("1", "2")]
    rows += [row("t", "transformers", "ar", "1", 20.0, 16.0, "x"), row("t", "transformers", "ar", "3", 1.0, 1.0)]
    got = {(e["target"], e["variant"]): e for e in versus_llamacpp_ar(rows, n_boot=50)}
    assert set(got) == {("l", "ooo@adaptive"), ("t", "ar")}  # request 3 has no llama.cpp ar row
    ooo, hf = got[("l", "ooo@adaptive")], got[("t", "ar")]
    assert ooo["end_to_end"]["ratio"] == 1.25 and ooo["decode"]["ratio"] == 2.0 and ooo["identical"] == 1.0
    assert hf["end_to_end"]["ratio"] == 0.5 and hf["n"] == 1 and hf["identical"] == 0.0
    assert any("ooo@adaptive" in line and "1.25x" in line for line in markdown(list(got.values())))


def test_no_llamacpp_target_no_table():
    assert versus_llamacpp_ar([row("t", "transformers", "ar", "1", 1.0, 1.0)]) == []
    assert markdown([]) == []
