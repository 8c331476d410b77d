"""What a rank tells its scheduler about its KV cache: bounded JSON, checked on the way in, never pickle."""

from __future__ import annotations

import os
import pickle

import pytest

from kvelastic.shared.errors import BadSharedData
from kvelastic.tp.rank_info import MAX_INFO_BYTES, RankInfo, decode_info, encode_info
from tests.kv_fixtures import build_cache
from tests.other_user import RunsCodeWhenUnpickled


def _info(limit=None):
    pool, views, cache = build_cache()
    info = RankInfo(rank=1, world=2, pid=os.getpid(), layout=cache.layout, group_bytes=cache.group_bytes,
                        page_bytes=pool.page_bytes, limit_bytes=limit, host_slots=3, slot_bytes=4096,
                        gpu_id="gpu-42245d53-03c8", gpu_total=80 << 30)
    return pool, views, cache, info


def test_a_rank_description_round_trips_with_its_layout():
    pool, _, cache, info = _info(limit=1 << 20)
    try:
        back = decode_info(encode_info(info), "rank 1's description")
        assert (back.rank, back.world, back.limit_bytes, back.host_slots) == (1, 2, 1 << 20, 3)
        assert (back.gpu_id, back.gpu_total) == ("gpu-42245d53-03c8", 80 << 30)  # the account it names
        assert back.layout.num_groups == cache.layout.num_groups
        assert all(back.layout.pages(g) == cache.layout.pages(g) for g in range(cache.layout.num_groups))
    finally:
        pool.close()


def test_a_description_carries_the_start_up_state_and_refuses_a_group_outside_its_layout_or_twice():
    """The groups a rank mapped before its scheduler existed and its applied mark (what the scheduler adopts
    instead of reading the board) come back as written; a description naming a group the layout lacks,
    or one twice, is refused like any malformed shared data."""
    import dataclasses
    import json

    pool, _, cache, info = _info()
    try:
        described = dataclasses.replace(info, start_groups=(0, 2, 5), applied=7)
        back = decode_info(encode_info(described), "x")
        assert (back.start_groups, back.applied) == ((0, 2, 5), 7)
        record = json.loads(encode_info(described))
        for groups, complaint in (([cache.layout.num_groups], "start_groups"), ([1, 1], "twice"),
                                  ([-1], "start_groups")):
            bad = json.dumps({**record, "start_groups": groups}).encode()
            with pytest.raises(BadSharedData, match=complaint):
                decode_info(bad, "x")
        with pytest.raises(BadSharedData, match="applied"):
            decode_info(json.dumps({**record, "applied": -1}).encode(), "x")
    finally:
        pool.close()


def test_a_description_names_its_rank_s_host_and_one_without_it_is_of_the_engine_core_s_host():
    """The host identity comes back as written; a description without one reads as "" (the engine core's
    host); anything but a bounded plain name is refused."""
    import dataclasses
    import json

    pool, _, _, info = _info()
    try:
        host = "0b0b0b0b-0000-4000-8000-000000000001/4026531836"
        assert decode_info(encode_info(dataclasses.replace(info, host=host)), "x").host == host
        record = json.loads(encode_info(info))
        del record["host"]
        assert decode_info(json.dumps(record).encode(), "x").host == ""
        for bad in ("a b", "x" * 161, "host\n", 7):
            with pytest.raises(BadSharedData, match="host"):
                decode_info(json.dumps({**record, "host": bad}).encode(), "x")
    finally:
        pool.close()


def test_a_pickle_or_an_oversized_description_is_refused_unread(tmp_path):
    marker = tmp_path / "ran"
    with pytest.raises(BadSharedData):
        decode_info(pickle.dumps(RunsCodeWhenUnpickled(str(marker))), "a rank's reply")
    assert not marker.exists()
    with pytest.raises(BadSharedData, match="more than the"):
        decode_info(b" " * (MAX_INFO_BYTES + 1), "a rank's reply")


def test_a_rank_description_out_of_range_is_refused():
    pool, _, _, info = _info()
    try:
        good = encode_info(info)
        for bad, complaint in ((good.replace(b'"rank":1', b'"rank":5'), "rank"),
                               (good.replace(b'"world":2', b'"world":0'), "world"),
                               (good.replace(b'"page_bytes":', b'"page_bytes":-', 1), "page_bytes"),
                               (good.replace(b'"limit_bytes":null', b'"limit_bytes":"lots"'), "limit_bytes"),
                               # the scheduler opens the account a rank names: never a path out of its folder
                               (good.replace(b'"gpu-42245d53-03c8"', b'"../../etc/gpu"'), "gpu_id"),
                               (good.replace(b'"gpu-42245d53-03c8"', b'"' + b"g" * 200 + b'"'), "gpu_id"),
                               (good.replace(b'"gpu-42245d53-03c8"', b'"gpu-42245d53-03c8\\n"'), "gpu_id"),
                               (good.replace(b'"gpu_total":', b'"gpu_total":-', 1), "gpu_total")):
            with pytest.raises(BadSharedData, match=complaint):
                decode_info(bad, "rank1.info")
    finally:
        pool.close()
