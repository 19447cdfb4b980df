"""The persistent compilation cache's default place and switch
(``jaxinfer.llm.enable_compilation_cache``); that a second process reads what a first wrote:
tests/test_sharding.py (the process it runs on 8 fake devices is the first)."""


def test_compilation_cache_is_on_by_default_in_the_documented_place(monkeypatch, tmp_path):
    """README: on by default in ~/.cache/jaxinfer/xla, JAXINFER_COMPILATION_CACHE=0 turns it off
    (that it is written and reused by a second process: tests/test_sharding.py)."""
    from jaxinfer import llm as llm_module

    calls = []
    monkeypatch.setattr(llm_module.jax.config, "update", lambda k, v: calls.append((k, v)))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("JAXINFER_CACHE_DIR", raising=False)
    monkeypatch.delenv("JAXINFER_COMPILATION_CACHE", raising=False)
    want = tmp_path / ".cache" / "jaxinfer" / "xla"
    assert llm_module.enable_compilation_cache() == str(want) and want.is_dir()
    assert ("jax_compilation_cache_dir", str(want)) in calls
    calls.clear()
    monkeypatch.setenv("JAXINFER_COMPILATION_CACHE", "0")
    assert llm_module.enable_compilation_cache() is None and calls == []
