"""The cost model's TCP streams: a connection reaches min(link, streams moving × one stream's
rate), the tuner prices inter-host algorithms at that rate, and `tensorwire plan` shows it at
the configured TENSORWIRE_NSOCKS / TENSORWIRE_SOCKET_THREADS and at more streams. Pure pricing:
no ranks are started."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_tuner import _Group

from tensorwire.algorithms.prices import Link
from tensorwire.algorithms.registry import algorithms_for
from tensorwire.config import Config
from tensorwire.tools import plan
from tensorwire.transport.pumps import AUTO_STREAMS, PUMP_BYTES, streams_per_pair
from tensorwire.tuning import cost_model, pricing, topology, tuner, tuning_file
from tensorwire.tuning.cost_model import STREAM, Links, LinkTable, Streams, predict, streams_of

LINK = Link("tcp", 30e-6, 1 / 12.5e9, 1 / 7.5e9)  # a 100 GbE link
ONE = Link(STREAM, 0.0, 1 / 3e9, 1 / 7.5e9)  # what one stream moves
BIG = 64 << 20


def rate(streams: Streams, piece: int = BIG) -> float:
    return 1 / streams.link(LINK, piece).beta  # type: ignore[union-attr]


def test_streams_fill_the_link_up_to_its_rate() -> None:
    """More streams (each with its two threads) never move a large message slower, and never
    faster than the link; without pump threads the rank's own thread drives every stream."""
    rates = [rate(Streams(k, 2 * k, ONE)) for k in range(1, 17)]
    assert rates[0] == pytest.approx(3e9) and rates[1] == pytest.approx(6e9)
    assert all(a <= b * (1 + 1e-12) for a, b in zip(rates, rates[1:])), rates
    assert max(rates) == pytest.approx(12.5e9) and all(r <= 12.5e9 * (1 + 1e-12) for r in rates)
    by_threads = [rate(Streams(4, t, ONE)) for t in range(12)]
    assert all(a <= b for a, b in zip(by_threads, by_threads[1:])), by_threads
    assert by_threads[0] == pytest.approx(3e9) and by_threads[-1] == pytest.approx(12e9)
    assert all(rate(Streams(k, 0, ONE)) == pytest.approx(3e9) for k in (1, 2, 8))
    # a driver per part, a part per PUMP_BYTES (as transport/tcp.py splits), one on one core
    wide = Streams(4, 8, ONE)
    assert wide.drivers((256 << 10) - 1) == wide.drivers(2 * PUMP_BYTES - 1) == 1
    assert wide.drivers(2 * PUMP_BYTES) == 2 and wide.drivers(4 * PUMP_BYTES - 1) == 3
    assert wide.drivers(4 * PUMP_BYTES) == 4 and replace(wide, cores=1.0).drivers(BIG) == 1
    for piece in (PUMP_BYTES, 2 * PUMP_BYTES, 3 * PUMP_BYTES + 1, 5 * PUMP_BYTES, BIG):
        for threads in (0, 2, 8, None):  # more streams: never fewer drivers
            drivers = [Streams(k, 2 * k if threads is None else threads, ONE).drivers(piece)
                       for k in range(1, 9)]
            assert drivers == sorted(drivers), (piece, threads, drivers)
    assert replace(wide, cores=0.5).drivers(BIG) == 1 and replace(wide, cores=2.0).drivers(BIG) == 2
    # a link measured through its streams is taken as it is; a slow link is not raised
    assert Streams(8, 16, None).link(LINK, BIG) == LINK
    slow = Link("tcp", 60e-6, 1 / 0.119e9, 0.0)
    assert Streams(8, 16, ONE).link(slow, BIG) == slow


def test_predict_prices_a_call_at_its_streams_rate() -> None:
    """An algorithm's price at a rank's streams is its price on a link of the rate they reach,
    for the call's share a rank (the ring's step): streams that cannot move it at once change
    nothing."""
    ring = algorithms_for("all_reduce")["ring"]
    for k, threads in ((1, 0), (2, 4), (4, 0), (4, 8), (8, 16)):
        streams = Streams(k, threads, ONE)
        at_rate = replace(LINK, beta=1 / rate(streams, BIG // 2))
        assert predict(ring, 2, BIG, Links(LINK, streams=streams)) == pytest.approx(
            ring.cost(2, BIG, at_rate))
    assert predict(ring, 8, 1 << 20, Links(LINK, streams=Streams(8, 16, ONE))) == pytest.approx(
        ring.cost(8, 1 << 20, replace(LINK, beta=ONE.beta)))


def test_streams_of_a_table() -> None:
    """A link the tuning file or the defaults state is filled by streams at the `tcp_stream`
    rate (the file's where it sets one); a calibrated or cached one already holds its streams;
    shared memory has none."""
    stated = tuning_file.apply_overrides(cost_model.default_table(), {"tcp": {"beta": LINK.beta}})
    streams = streams_of(stated, "tcp", 4, 8)
    assert streams is not None and streams.stream == cost_model.DEFAULT_LINKS[STREAM]
    faster = tuning_file.apply_overrides(stated, {STREAM: {"beta": 1 / 5e9}})
    assert streams_of(faster, "tcp", 1, 0).stream.beta == pytest.approx(1 / 5e9)  # type: ignore[union-attr]
    assert streams_of(cost_model.default_table(), "tcp", 1, 0).stream is not None  # type: ignore[union-attr]
    for source in ("calibrated", "cached"):
        measured = LinkTable({"tcp": LINK}, {"tcp": source})
        assert streams_of(measured, "tcp", 8, 16).stream is None  # type: ignore[union-attr]
    assert streams_of(stated, "shm", 8, 16) is None


def _cluster_group(nsocks: int, threads: int | None, table: LinkTable) -> _Group:
    g = _Group(8, "tcp", replace(Config(), nsocks=nsocks, socket_threads=threads))
    g.layout = topology.Layout(((0, 1), (2, 3), (4, 5), (6, 7)), (1, 1, 1, 1))
    tuner.install(g.runtime, table)
    return g


def test_the_tuner_prices_inter_host_algorithms_at_the_streams_rate() -> None:
    """4 hosts of 2 ranks over a stated 12.5 GB/s link: 64 MiB all_reduce runs the hierarchical
    algorithm, priced faster on 2 streams than on one (3 GB/s between hosts) and never slower on
    more; threads 0 make the streams one driver's; a measured link keeps its price whatever the
    settings."""
    stated = tuning_file.apply_overrides(cost_model.default_table(), {"tcp": {"alpha": LINK.alpha,
                                                                             "beta": LINK.beta}})
    prices = {}
    for k in (1, 2, 4, 8):
        decision = tuner.decide(_cluster_group(k, None, stated), "all_reduce", BIG)
        prices[k] = (decision.choice.name, decision.priced[0][0])
    assert all(name == "hierarchical" for name, _ in prices.values()), prices
    assert prices[1][1] > prices[2][1] >= prices[4][1] * (1 - 1e-9) >= prices[8][1] * (1 - 2e-9), prices
    g = _cluster_group(4, 0, stated)
    assert tuner.decide(g, "all_reduce", BIG).priced[0][:2] == (prices[1][1], "hierarchical")
    line = tuner.explain(g, tuner.decide(g, "all_reduce", BIG))
    assert "4 stream(s) a pair with 0 thread(s) a rank, each stream at most 3 GB/s (default)" in line, line
    measured = LinkTable({"tcp": LINK}, {"tcp": "calibrated"})
    same = {tuner.decide(_cluster_group(k, None, measured), "all_reduce", BIG).priced[0][0] for k in (1, 8)}
    assert len(same) == 1, same


def test_the_tuner_prices_the_streams_and_threads_its_ranks_use() -> None:
    """Calibration agrees on what every rank offers (its streams a pair, pump threads, cores):
    a group's TCP calls are priced with the fewest of its ranks' (a pair opens the fewer of its
    two ranks' streams), the same on every rank whatever this host has, and the TUNING log says so."""
    stated = tuning_file.apply_overrides(cost_model.default_table(), {"tcp": {"alpha": LINK.alpha,
                                                                             "beta": LINK.beta}})
    agreed = replace(stated, extra={"streams": [(4, 7, 8.0), (1, 0, 1.0), (4, 7, 8.0), (2, 3, 4.0)]})
    g = _Group(4, "tcp", Config())  # TENSORWIRE_NSOCKS=auto: the settings say nothing of what ranks use
    tuner.install(g.runtime, agreed)
    for ranks, expected in (([0, 2], (4, 7, 8.0)), ([0, 1, 2, 3], (1, 0, 1.0)), ([0, 3], (2, 3, 4.0))):
        g.ranks, g.size = ranks, len(ranks)
        streams = tuner.streams_for(g, agreed)
        assert streams is not None and (streams.nsocks, streams.threads, streams.cores) == expected, ranks
        line = tuner.explain(g, tuner.decide(g, "all_reduce", BIG))
        assert f"{expected[0]} stream(s) a pair with {expected[1]} thread(s) a rank" in line, line


def test_plan_shows_what_more_streams_give(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tensorwire plan --hosts` names TENSORWIRE_NSOCKS and TENSORWIRE_SOCKET_THREADS with what
    they are here, and prices 1, 2, 4 and 8 streams beside them: with threads 0 more streams
    give nothing, with `auto`'s threads (16 cores, one rank a host) up to the link."""
    monkeypatch.delenv("TENSORWIRE_TUNING_FILE", raising=False)
    monkeypatch.delenv("TENSORWIRE_NSOCKS", raising=False)
    monkeypatch.setenv("TENSORWIRE_SOCKET_THREADS", "0")
    lines: list[str] = []
    assert plan.main(["all_reduce", "64MiB", "--hosts", "2", "--per-host", "1", "--cores", "16", "--tier",
                      "shm=2:9,eth100=30:12.5"], lines.append) == 0
    text = "\n".join(lines)
    assert ("streams between hosts: TENSORWIRE_NSOCKS=auto (4 a pair), TENSORWIRE_SOCKET_THREADS=0 (0 a "
            "rank, 1 rank(s) on 16 cores)") in text, text
    assert "one stream moves at most 3 GB/s, default tcp_stream" in text, text
    rows = {}
    for line in lines:
        if line.startswith("  at NSOCKS="):
            setting, _, rest = line[len("  at "):].partition(": ")
            k, threads = (int(v.split("=")[1]) for v in setting.split())
            words = rest.split()
            unit = {"us": 1e-6, "ms": 1e-3, "s": 1.0}[words[5]]
            rows[(k, threads)] = (float(words[0]), float(words[4]) * unit, rest)
    assert "<- configured" in rows[(4, 0)][2], text
    assert all(rows[(k, 0)][0] == 3 for k in (1, 2, 4, 8)), text  # threads 0: one driver
    assert rows[(2, 4)][0] == 6 and rows[(4, 8)][0] == 12 and rows[(8, 15)][0] == 12.5, text
    assert rows[(8, 15)][1] <= rows[(4, 8)][1] < rows[(2, 4)][1] < rows[(1, 0)][1], text
    # a link measured here is priced as measured: the plan says how to price more streams
    out: list[str] = []
    local = pricing.Tier("shm", Link("shm", 2e-6, 1 / 9e9, 1 / 7.5e9), "given")
    measured = pricing.Tier("tcp", LINK, "cached")
    plan.report_streams("all_reduce", BIG, 2, 1, 1, local, measured, Config(), 16, out.append)
    assert "measured through them" in out[1] and "NAME=ALPHA_US:GBPS" in out[1], out


def test_streams_per_pair_auto_and_bad_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    """TENSORWIRE_NSOCKS=auto (the default): AUTO_STREAMS where a rank has a core to spare,
    one where ranks share cores or the hard limit of descriptors could not hold that many to
    every peer; a count outside 1..64 is an error naming the setting."""
    import resource

    assert Config.from_env().nsocks is None
    assert [streams_per_pair(None, cores, 2) for cores in (2, 3, 4, 16)] == [1, 1, AUTO_STREAMS, AUTO_STREAMS]
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY:
        assert streams_per_pair(None, 16, 2, peers=hard // AUTO_STREAMS) == 1
        assert streams_per_pair(None, 16, 2, peers=hard // AUTO_STREAMS // 2) == AUTO_STREAMS
    assert streams_per_pair(2, 2, 2) == 2
    for raw in ("0", "65", "x"):
        monkeypatch.setenv("TENSORWIRE_NSOCKS", raw)
        with pytest.raises(ValueError, match=f"TENSORWIRE_NSOCKS='{raw}': expected auto or a number"):
            Config.from_env()
