"""The package's public surface: what tab completion and ``from dptorch import *`` offer."""

import dptorch


def test_dir_lists_the_public_names_and_not_the_helpers():
    names = [n for n in dir(dptorch) if not n.startswith("_")]
    assert set(dptorch.__all__) <= set(names)
    assert "Any" not in names and "import_module" not in names
    for name in dptorch.__all__:
        assert getattr(dptorch, name) is not None
