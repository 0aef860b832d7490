"""Lastfm-2K (HetRec 2011): the artists 1,892 Last.fm users listened to.

``user_artists.dat``: tab-separated with the header ``userID artistID weight``. The listening count is not a rating:
every row is a positive; the weight is kept in ``rating``. The file has no timestamps.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fedrec_flwr.data.datasets.spec import DatasetSpec, Parsed
from fedrec_flwr.data.parsing import build_frame, read_table


def read(paths: Mapping[str, Path]) -> Parsed:
    """Every (user, artist) row of ``user_artists.dat``, its listening count as the rating."""
    table = read_table(paths["user_artists.dat"], sep="\t", header=True)
    frame = build_frame(
        table, paths["user_artists.dat"], user="userID", item="artistID", rating="weight", timestamp=None
    )
    return Parsed(frame, table.lines, None)


SPEC = DatasetSpec(
    name="lastfm-2k",
    title="Lastfm-2K",
    url="https://files.grouplens.org/datasets/hetrec2011/hetrec2011-lastfm-2k.zip",
    sha256={"user_artists.dat": "001400dc3c7d2667fca6e4ea6dc6acc31a9dd28ad5cd0f74cea988c019934d3b"},
    files=("user_artists.dat",),
    read=read,
)
