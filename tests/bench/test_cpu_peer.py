"""Bookkeeping of bench/cpu_peer.py without servers: prompt windows, the token-agreement figure, the CPU it records,
the llama-server builds it may ask for and where bench/peers/llama_server.py caches them, the phase sizes per model size,
the comparison with the faster build and the table it prints."""
import random
import tarfile
from dataclasses import asdict
from pathlib import Path

import pytest

from bench.big_model import ModelSize
from bench.cpu_peer import (SIZES, agreement, bandwidth_shares, compare, cpu_identity, figure_rows, parse_args,
                            render_table, windows)
from bench.peers.llama_server import (SDIST_ENV, SWITCHES, TOOLS, VERSION, Build, PeerUnavailable, cache_dir,
                                ensure_build, ensure_llama_server, host_builds, llama_tools, source_dir, source_tree,
                                tool_path)


def test_windows_are_slices_of_the_pool_with_the_asked_lengths():
    pool = list(range(1000))
    got = windows(pool, [16, 256, 999], random.Random(0))
    assert [len(w) for w in got] == [16, 256, 999]
    for w in got:  # contiguous runs of the pool: real text, not a shuffle
        assert w == pool[w[0]:w[0] + len(w)]


def test_agreement_names_the_first_difference_per_prompt():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]]
    got = agreement([[1, 2, 3, 4], [5, 6, 0, 8], [0, 9, 9, 9]], ref)
    assert got == {"identical_share": 1 / 3, "first_difference": [None, 2, 0]}


def test_the_cpu_identity_names_this_cpus_vector_flags() -> None:
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    ident = cpu_identity()
    if not flags:
        assert ident == {} or not ident["vector_flags"]
        return
    assert ident["model"] and ident["vector_flags"] and set(ident["vector_flags"]) <= flags
    assert {"avx2", "fma"} & flags <= set(ident["vector_flags"])  # what the AVX2 comparison is about


def test_an_unknown_llama_server_build_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown llama-server build"):
        ensure_llama_server(isa="avx9")


def test_the_cache_layout_holds_each_builds_tools_and_the_source(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    root = tmp_path / "llama.cpp" / VERSION
    assert cache_dir() == root and source_dir() == root / "src"
    assert tool_path("avx512", "llama-quantize") == root / "avx512" / "llama-quantize"
    assert tool_path(Build.AVX2) == root / "avx2" / "llama-server"
    with pytest.raises(ValueError, match="unknown llama.cpp tool"):
        tool_path("avx2", "llama-cli")
    # binaries copied in by hand and an extracted tree are used as they are: nothing is built or downloaded
    for tool in TOOLS:
        (root / "avx2").mkdir(parents=True, exist_ok=True)
        (root / "avx2" / tool).write_text("#!/bin/sh\n")
        (root / "avx2" / tool).chmod(0o755)
    _fake_tree(root / "src")
    monkeypatch.setattr("shutil.which", lambda name: pytest.fail(f"looked for {name}: a build was attempted"))
    assert ensure_build("avx2") == root / "avx2"
    assert ensure_llama_server(isa="avx2") == root / "avx2" / "llama-server"
    tools = llama_tools()
    assert tools.quantize == root / "avx2" / "llama-quantize" and tools.convert == root / "src" / "convert_hf_to_gguf.py"


def _fake_tree(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "CMakeLists.txt").write_text("project(llama.cpp)\n")
    (path / "convert_hf_to_gguf.py").write_text("# converter\n")
    (path / "gguf-py").mkdir()
    (path / "gguf-py" / "x.py").write_text("")
    (path / "build").mkdir()  # an earlier build's directory: not part of the source
    (path / "build" / "CMakeCache.txt").write_text("")
    return path


def test_the_source_comes_from_a_given_sdist_archive_once(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    tree = _fake_tree(tmp_path / "sd" / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp")
    archive = tmp_path / f"llama_cpp_python-{VERSION}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree.parents[1], arcname=f"llama_cpp_python-{VERSION}")
    monkeypatch.setenv(SDIST_ENV, str(archive))
    got = source_tree()
    assert got == source_dir() and (got / "gguf-py" / "x.py").is_file() and not (got / "build").exists()
    archive.unlink()  # extracted once: the archive is not needed again
    assert source_tree() == got


def test_a_given_sdist_that_holds_no_llama_cpp_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path / "cache"))
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv(SDIST_ENV, str(tmp_path / "empty"))
    with pytest.raises(PeerUnavailable, match="no llama.cpp source tree"):
        source_tree()
    monkeypatch.setenv(SDIST_ENV, str(tmp_path / "missing.tar.gz"))
    with pytest.raises(PeerUnavailable, match="no such file"):
        source_tree()


def test_the_avx512_build_runs_only_where_the_cpu_has_what_it_was_compiled_with() -> None:
    avx2 = ["avx", "avx2", "fma", "f16c"]
    full = avx2 + ["avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi"]
    assert host_builds(avx2) == [Build.AVX2]
    assert host_builds(full) == [Build.AVX2, Build.AVX512]
    assert host_builds([f for f in full if f != "avx512vbmi"]) == [Build.AVX2]
    assert "-DGGML_AMX_INT8=OFF" in SWITCHES[Build.AVX512] and "-DGGML_NATIVE=OFF" in SWITCHES[Build.AVX512]
    assert "-DGGML_AVX512=OFF" in SWITCHES[Build.AVX2]


def test_the_model_size_picks_the_phase_sizes_and_the_result_file() -> None:
    args = parse_args(["--model-size", "1.7b"])
    want = SIZES[ModelSize.SMOLLM2_1P7B]
    assert (args.new_tokens, args.concurrency, args.prefill_rounds) == (want.new_tokens, want.concurrency,
                                                                        want.prefill_rounds)
    assert args.concurrent_prompt_tokens == want.concurrent_prompt_tokens and args.isa == "auto"
    assert args.out.name == "cpu_peer_1.7b_q4_k_m.json"
    args = parse_args(["--model-size", "1.7b", "--quant", "q8_0", "--isa", "avx2", "--new-tokens", "5"])
    assert args.out.name == "cpu_peer_1.7b_q8_0_avx2.json" and args.new_tokens == 5
    args = parse_args([])
    assert args.out.name == "cpu_peer.json" and args.new_tokens == SIZES[ModelSize.SMOLLM2_135M].new_tokens
    assert parse_args(["--model-size", "gemma-270m", "--isa", "avx2"]).out.name == "cpu_peer_gemma-270m_avx2.json"
    int8 = parse_args(["--model-size", "gemma-270m", "--isa", "avx2", "--cpu-activations", "int8"])
    assert int8.out.name == "cpu_peer_gemma-270m_avx2_int8.json" and int8.cpu_activations == "int8"
    assert parse_args([]).cpu_activations == "auto"  # what `tandem serve` users get
    for bad in (["--model", "x.gguf", "--model-size", "1.7b"], ["--concurrent-new-tokens", "9", "3"],
                ["--model-size", "7b"], ["--cpu-activations", "int4"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def _result(rates: dict[str, tuple[float, float, float, float]]) -> dict:
    """A run's figures from (incl. prefill, decode, prefill, 32 at once) rates per system."""
    batch1 = {n: {"median_tok_s_incl_prefill": r[0], "median_decode_tok_s": r[1]} for n, r in rates.items()}
    result = {"batch1": batch1, "prefill": {n: {"best_tok_s": r[2]} for n, r in rates.items()},
              "concurrent": {"32": {n: {"useful_tok_s": r[3]} for n, r in rates.items()}}}
    result["vs_faster_build"] = compare(figure_rows(result))
    return result


def test_each_figure_is_compared_with_the_faster_build_and_names_it() -> None:
    rates = {"tandem": (10.0, 12.0, 100.0, 80.0), "llama_cpp_avx2": (11.0, 11.5, 90.0, 30.0),
             "llama_cpp_avx512": (8.0, 12.5, 120.0, 35.0)}
    vs = _result(rates)["vs_faster_build"]
    for i, key in enumerate(["batch1", "decode", "prefill", "concurrent32"]):
        peers = {n: r[i] for n, r in rates.items() if n != "tandem"}
        best = max(peers, key=peers.get)
        assert vs[key]["faster_build"] == best.removeprefix("llama_cpp_")
        assert vs[key]["ratio"] == pytest.approx(rates["tandem"][i] / peers[best])
    assert compare({"batch1": {"tandem": 1.0}}) == {}  # no peer ran: no ratio


def test_the_table_shows_every_build_the_ratio_and_the_conditions() -> None:
    rates = {"tandem": (10.0, 12.0, 100.0, 80.0), "llama_cpp_avx2": (11.0, 11.5, 90.0, 30.0),
             "llama_cpp_avx512": (8.0, 12.5, 120.0, 35.0)}
    result = _result(rates)
    result.update({"model": "q4_k_m.gguf", "model_size": "1.7b", "quant": "q4_k_m", "paths": {"tandem": "avx512"},
                   "isa": "auto", "threads": 2, "commit": "abc1234", "loadavg": (0.5, 0.5, 0.5), "contended": False,
                   "cpu": {"model": "Some CPU", "vector_flags": ["avx2", "avx512f"]}, "builds": ["avx2", "avx512"],
                   "skipped": {}, "settings": asdict(SIZES[ModelSize.SMOLLM2_1P7B]),
                   "bandwidth": {"gbps": 20.0}, "decode_bytes_per_token": {"bytes": 1_000_000_000},
                   "vs_transformers": {"tandem": {"first_difference": [None, 3, None]}}})
    result["decode_bandwidth_share"] = bandwidth_shares(result, 1_000_000_000, 20.0)
    assert result["decode_bandwidth_share"]["tandem"] == pytest.approx(12.0 / 20.0)
    table = render_table(result)
    lines = table.splitlines()
    assert "abc1234" in lines[0] and "avx512f" in lines[0] and "Some CPU" in lines[0]
    header = lines[2]
    assert "llama-server avx2" in header and "llama-server avx512" in header and "faster build" in header
    rows = [line for line in lines if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 6  # four figures, the bandwidth share, token identity
    prefill = next(r for r in rows if "prefill tok/s" in r)
    assert f"**{100.0 / 120.0:.2f}x**" in prefill and prefill.rstrip(" |").endswith("avx512")
    assert "60%" in rows[4] and "2/3 (first difference at 3)" in rows[5]
    result["skipped"] = {"llama_cpp_avx512": "exited with -4"}  # a build that did not start has no column
    assert "llama-server avx512" not in render_table(result)
    for skipped in ({"llama_cpp_avx512": "x"}, {"llama_cpp_avx512": "x", "llama_cpp_avx2": "y"}, {}):
        result["skipped"] = skipped
        rows = [line for line in render_table(result).splitlines() if line.startswith("|")]
        assert len({line.count("|") for line in rows}) == 1, rows  # every row has the header's columns
