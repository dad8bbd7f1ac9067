"""The benchmarks' shared helpers (`benchmarks.common`) that need no GPU."""

import re

from hypothesis import given, strategies as st

from benchmarks import common


@given(st.text(max_size=40))
def test_a_file_stem_keeps_only_portable_characters(text):
    stem = common.file_stem(text)
    assert len(stem) == len(text) and re.fullmatch(r"[A-Za-z0-9._-]*", stem)
    # what was portable already is kept as it was
    assert all(a == b for a, b in zip(text, stem) if re.fullmatch(r"[A-Za-z0-9._-]", a))


def test_a_composition_setting_becomes_a_file_stem():
    assert common.file_stem("threshold0.5+quest0.2") == "threshold0.5_quest0.2"
    assert common.file_stem("dense@32768x16") == "dense_32768x16"
