"""The data plane of the Beam bounding: partition state in the partition store vs carried in the graph.

Each round of the bounding joins every partition's state with the messages sent to it, three times.
This measures that data plane alone, on partition state the size of the bounding's user side for N
records (mean arity 2: 2N incidences; about N/2 users), in P partitions, through J joins:
- store: elements are handles; the static arrays are written once and read once per worker (cached),
  the changing ones (eligibility, residual capacity) are read and written by each join
  (`beam_pipelines.store`, as the pipelines do);
- in-graph: elements are the state itself, Arrow chunks (the same encoding) carried through each
  Flatten + GroupByKey, as a Beam-native pipeline would.
Both run on the DirectRunner with 2 worker processes; the wall time is that of the whole pipeline,
start-up included (the same in both), best of --repeats.

    python benchmarks/store.py [--records 2000000,10000000] [--partitions 4] [--joins 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import apache_beam as beam  # noqa: E402
import numpy as np  # noqa: E402

from beam_pipelines.pipeline import pipeline_options  # noqa: E402
from beam_pipelines.store import PartitionStore, decode, encode, read_static  # noqa: E402

MESSAGE_SHARE = 0.05  # records named in messages per join, as a share of all records


def partition_state(records: int, partitions: int, part: int) -> tuple[dict, dict]:
    """(static, changing) arrays of one user partition for `records` records."""
    rng = np.random.default_rng(part)
    incidences, users, owned = 2 * records // partitions, records // (2 * partitions), records // partitions
    static = {
        "inc_user": np.sort(rng.integers(0, users, incidences)),
        "inc_record": rng.integers(0, owned, incidences),
        "record_keys": np.sort(rng.integers(0, 1 << 62, owned)),
        "first_incidence": np.sort(rng.integers(0, incidences, users)),
        "capacity": np.full(users, 3, np.int64),
        "record_partition": rng.integers(0, partitions, owned),
        "coowners": rng.integers(0, 1 << 4, (owned, 1)).astype(np.uint64),
        "owner": rng.random(owned) < 0.5,
    }
    changing = {"eligible": np.ones(incidences, bool), "residual": np.full(users, 3, np.int64)}
    return static, changing


def messages(part: int, partitions: int, records: int, join: int):
    """Record keys a partition sends to every partition in one join."""
    rng = np.random.default_rng((part, join))
    size = int(MESSAGE_SHARE * records / partitions**2)
    for destination in range(partitions):
        yield destination, ("message", rng.integers(0, 1 << 62, size))


def apply(changing: dict, keys: list[np.ndarray], join: int) -> dict:
    """A step's change: some incidences leave, some capacity is used."""
    eligible = changing["eligible"].copy()
    eligible[join::97] = False
    residual = np.maximum(changing["residual"] - (sum(len(k) for k in keys) % 2), 0)
    return {"eligible": eligible, "residual": residual}


class StoreJoin(beam.DoFn):
    def __init__(self, store: PartitionStore, records: int, partitions: int, join: int):
        self.store, self.records, self.partitions, self.join = store, records, partitions, join

    def process(self, element):
        part, values = element
        (handle,) = [v for kind, v in values if kind == "state"]
        keys = [v for kind, v in values if kind == "message"]
        static = read_static(handle[0])
        changing = apply(self.store.read_arrays(handle[1]), keys, self.join)
        assert len(changing["eligible"]) == len(static["inc_user"])
        path = self.store.write_arrays(f"{part:05d}-join{self.join}-{uuid.uuid4().hex[:8]}.store", changing)
        yield part, ("state", (handle[0], path))
        yield from messages(part, self.partitions, self.records, self.join + 1)


class InGraphJoin(beam.DoFn):
    def __init__(self, records: int, partitions: int, join: int):
        self.records, self.partitions, self.join = records, partitions, join

    def process(self, element):
        part, values = element
        (blob,) = [v for kind, v in values if kind == "state"]
        keys = [v for kind, v in values if kind == "message"]
        state = decode(blob, "in-graph state")
        state["changing"] = apply(state["changing"], keys, self.join)
        yield part, ("state", encode(state))
        yield from messages(part, self.partitions, self.records, self.join + 1)


def build(part: int, mode: str, store: PartitionStore, records: int, partitions: int):
    static, changing = partition_state(records, partitions, part)
    if mode == "store":
        handle = (
            store.write_arrays(f"{part:05d}-static.store", static),
            store.write_arrays(f"{part:05d}.store", changing),
        )
    else:
        handle = encode({"static": static, "changing": changing})
    yield part, ("state", handle)
    yield from messages(part, partitions, records, 0)


def run_once(mode: str, records: int, partitions: int, joins: int, directory: str) -> float:
    store = PartitionStore(os.path.join(directory, uuid.uuid4().hex[:8]))
    pipeline = beam.Pipeline(options=pipeline_options([]))
    elements = (
        pipeline
        | "Partitions" >> beam.Create(list(range(partitions)))
        | "Build" >> beam.FlatMap(build, mode, store, records, partitions)
    )
    for join in range(joins):
        step = (
            StoreJoin(store, records, partitions, join) if mode == "store" else InGraphJoin(records, partitions, join)
        )
        elements = elements | f"Join{join}" >> beam.GroupByKey() | f"Step{join}" >> beam.ParDo(step)
    _ = elements | "Count" >> beam.combiners.Count.Globally()
    started = time.perf_counter()
    pipeline.run().wait_until_finish()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", default="2000000,10000000", help="comma-separated record counts")
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--joins", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as directory:
        for records in map(int, args.records.split(",")):
            row = {"records": records, "state_mb": None}
            static, changing = partition_state(records, args.partitions, 0)
            row["state_mb"] = round(args.partitions * len(encode({"s": static, "c": changing})) / 2**20, 1)
            for mode in ("store", "in-graph"):
                times = [run_once(mode, records, args.partitions, args.joins, directory) for _ in range(args.repeats)]
                row[f"{mode}_s"] = round(min(times), 2)
                print(
                    f"{records:>11,} records, {mode:>8}: best {min(times):.2f} s, slowest {max(times):.2f} s",
                    flush=True,
                )
            row["in_graph_over_store"] = round(row["in-graph_s"] / row["store_s"], 2)
            results.append(row)
    print(json.dumps({"partitions": args.partitions, "joins": args.joins, "runs": results}, indent=2))


if __name__ == "__main__":
    main()
