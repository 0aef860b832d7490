"""Amazon-Video (McAuley's 2014 Amazon ratings CSV), as PFedRec's repository ships it (``data/amazon/ratings.dat``,
pinned to one commit).

``ratings.dat``: comma-separated ``reviewer,asin,rating,timestamp`` rows, no header. Ids are Amazon reviewer ids and
ASINs (upper-case letters and digits), checked against every row of the shipped file.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from fedrec_flwr.data.datasets.spec import DatasetSpec, Parsed
from fedrec_flwr.data.parsing import build_frame, read_table

REVIEWER_ID = (re.compile(r"[A-Z0-9]+"), "an Amazon reviewer id (upper-case letters and digits)")
ASIN = (re.compile(r"[A-Z0-9]+"), "an ASIN (upper-case letters and digits)")


def read(paths: Mapping[str, Path]) -> Parsed:
    """Every (reviewer, ASIN) row of ``ratings.dat``, with its rating and unix timestamp."""
    table = read_table(paths["ratings.dat"], sep=",", header=False)
    frame = build_frame(
        table,
        paths["ratings.dat"],
        user=0,
        item=1,
        rating=2,
        timestamp=3,
        expect_cols=4,
        id_kinds=(REVIEWER_ID, ASIN),
    )
    return Parsed(frame, table.lines, None)


SPEC = DatasetSpec(
    name="amazon-video",
    title="Amazon-Video",
    url=(
        "https://raw.githubusercontent.com/Zhangcx19/IJCAI-23-PFedRec/"
        "abc23809b9bca8f4f09fab5311ae4a63ed6159d2/data/amazon/ratings.dat"
    ),
    sha256={"ratings.dat": "a1292e4a4dba6c37be6ae5dc83d4404af96bf3eace4c8954e2f4e8360a3cdd76"},
    files=("ratings.dat",),
    read=read,
)
