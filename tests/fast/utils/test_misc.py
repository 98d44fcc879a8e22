import pytest

from miles.utils.misc import HookLoadError, function_registry, load_function


def test_dotted_path_loads_a_function():
    assert load_function("os.path.join")("a", "b") == "a/b"


def test_file_path_loads_a_function(tmp_path):
    hook = tmp_path / "hooks.py"
    hook.write_text("def double(x):\n    return 2 * x\n")
    assert load_function(f"{hook}:double")(4) == 8


@pytest.mark.parametrize(
    ("path", "named"),
    [
        ("no_such_pkg_xyz.fn", "no_such_pkg_xyz"),
        ("os.path.no_such_fn", "no_such_fn"),
        ("/nonexistent/dir/hooks.py:fn", "/nonexistent/dir/hooks.py"),
    ],
)
def test_missing_module_file_or_attribute_is_named(path, named):
    with pytest.raises(HookLoadError, match=named.replace(".", r"\.")):
        load_function(path)


def test_missing_attribute_in_file_is_named(tmp_path):
    hook = tmp_path / "hooks.py"
    hook.write_text("x = 1\n")
    with pytest.raises(HookLoadError, match="no attribute 'fn'"):
        load_function(f"{hook}:fn")
    with pytest.raises(HookLoadError, match="not callable"):
        load_function(f"{hook}:x")


def test_registry_injects_functions_without_files():
    with function_registry.temporary("test.inline_fn", lambda: 42) as name:
        assert load_function(name)() == 42
    with pytest.raises(HookLoadError):
        load_function("test.inline_fn")


def test_hooks_from_one_file_share_module_state(tmp_path):
    hook = tmp_path / "stateful.py"
    hook.write_text("SEEN = []\ndef add(x):\n    SEEN.append(x)\ndef seen():\n    return list(SEEN)\n")
    load_function(f"{hook}:add")(1)
    assert load_function(f"{hook}:seen")() == [1]
