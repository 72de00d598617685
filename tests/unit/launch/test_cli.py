"""The pipeq console script."""


from pipeq.launch.cli import main


def test_schedule_table(capsys):
    assert main(["schedule", "1f1b", "--stages", "3", "--microbatches", "4", "--backward-cost", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1f1b: 3 stages x 4 microbatches"
    assert out[1].split("|")[1].split()[:4] == ["F0", "F1", "F2", "."]
    assert len(out) == 4


def test_bad_counts_exit_2(capsys):
    assert main(["schedule", "gpipe", "--stages", "0", "--microbatches", "4"]) == 2
    assert "at least one stage" in capsys.readouterr().err


def test_secret_prints_a_fresh_one(capsys):
    assert main(["secret"]) == 0
    first = capsys.readouterr().out
    assert main(["secret"]) == 0
    second = capsys.readouterr().out
    for out in (first, second):
        assert out.endswith("\n") and len(out.strip()) == 64
        int(out, 16)  # hex
    assert first != second


def test_secret_out_is_a_new_file_only_its_owner_may_read(tmp_path, capsys):
    import os
    import stat

    from pipeq.wire.keys import JobSecret

    path = tmp_path / "job.secret"
    old = os.umask(0o022)  # the usual umask: a plain `> file` would be readable by others
    try:
        assert main(["secret", "--out", str(path)]) == 0
    finally:
        os.umask(old)
    assert capsys.readouterr().out == ""  # the secret is not printed
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    loaded = JobSecret.load(str(path), env={})
    assert loaded == JobSecret.from_text(path.read_text())
    text = path.read_text()
    assert main(["secret", "--out", str(path)]) == 2  # never overwritten: the nodes share it
    assert "already exists" in capsys.readouterr().err
    assert path.read_text() == text


def test_a_compiled_jobs_fork_server_is_told_before_torch_is_imported(tmp_path):
    """``pipeq launch`` starts its fork server first thing; for a job with ``compile`` it imports
    torch.compile's machinery too (pipeq.runtime.preload_compile), read from the job file as TOML."""
    from pipeq.launch.cli import _compiles

    compiled, eager, broken = tmp_path / "c.toml", tmp_path / "e.toml", tmp_path / "b.toml"
    compiled.write_text('compile = { backend = "aot_eager" }\n')
    eager.write_text("steps = 3\n")
    broken.write_text("compile = [\n")
    assert _compiles([str(compiled), "--steps", "2"]) is True
    assert _compiles(["--quiet", str(eager)]) is False
    assert _compiles([str(broken)]) is False  # the launch says what is wrong with it
    assert _compiles([str(tmp_path / "missing.toml")]) is False
