"""engine.kernels.cbuild: a cached kernel is rebuilt when its source or a header it includes changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.kernels import cbuild


def test_a_changed_local_header_rebuilds_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "k.c"
    (tmp_path / "value.h").write_text("#define VALUE 1\n")
    src.write_text('#include "value.h"\nint value(void) { return VALUE; }\n')
    assert cbuild.local_headers(src) == [tmp_path / "value.h"]
    assert cbuild.build(src, ()).value() == 1
    (tmp_path / "value.h").write_text("#define VALUE 2\n")
    assert cbuild.build(src, ()).value() == 2  # not the cached build of the old header
    assert len(list((tmp_path / "cache").glob("k-*.so"))) == 2


def test_system_and_missing_headers_are_not_part_of_the_key(tmp_path: Path) -> None:
    src = tmp_path / "k.c"
    src.write_text('#include <stdint.h>\n#include "absent.h"\n  #  include "here.h"\n')
    (tmp_path / "here.h").write_text("")
    assert cbuild.local_headers(src) == [tmp_path / "here.h"]


def test_a_header_a_header_includes_rebuilds_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """w4mm.c includes w4mm_common.h, which includes thread_buffer.h: a change two includes down rebuilds it."""
    monkeypatch.setenv("TIANMEN_KERNEL_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "k.c"
    (tmp_path / "outer.h").write_text('#include "inner.h"\n#include "outer.h"\n')  # and a cycle, guarded
    (tmp_path / "inner.h").write_text("#ifndef VALUE\n#define VALUE 1\n#endif\n")
    src.write_text('#include "outer.h"\nint value(void) { return VALUE; }\n')
    assert cbuild.local_headers(src) == [tmp_path / "outer.h", tmp_path / "inner.h"]
    (tmp_path / "outer.h").write_text('#include "inner.h"\n')
    assert cbuild.build(src, ()).value() == 1
    (tmp_path / "inner.h").write_text("#define VALUE 2\n")
    assert cbuild.build(src, ()).value() == 2
