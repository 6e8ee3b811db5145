"""bench/engine_bench.py ``fused_mlp_rows`` on the CPU (interpreted kernels, small shapes, a stand-in timer): it
counts the layers whose one-launch output equals the three launches' bit for bit, times both graphs twice each and
keeps the best, and skips an M whose plans are not the one-warp mma GEMV (printed)."""


def test_fused_mlp_rows_compare_bits_and_time_both_paths(capsys):
    from bench.engine_bench import fused_mlp_rows

    timed, ran = [], set()

    def timer(calls, replays):  # per M: the three launches twice, then the one launch twice
        if id(calls) not in ran:  # each list's calls run once (they are what the GPU would capture)
            ran.add(id(calls))
            assert all(c().shape == (8, 256) for c in calls)
        timed.append(len(calls))
        return {1: 31.0, 2: 30.0, 3: 26.0, 4: 25.0}[len(timed)]

    make_row = lambda *cells: cells  # noqa: E731
    rows = fused_mlp_rows({}, make_row, layers=1, hidden=256, inter=256, device="cpu", timer=timer)
    # at M = 1 the 256 -> 256 down projection takes the CUDA-core GEMV (w4a16.choose_plan): skipped
    assert "fused_mlp_rows: M=1 skipped" in capsys.readouterr().out
    assert len(rows) == 1 and timed == [1, 1, 1, 1]
    measure, shape, ours, baseline, base_us, target, note = rows[0]
    assert shape == "256->2x256->256, M=8, 1 layers in one graph" and (ours, base_us, target) == (25.0, 30.0, None)
    assert note.startswith("1 of 1 layers bit-identical; splits 2 / 2;") and note.endswith("saves +5.0 µs a layer")
