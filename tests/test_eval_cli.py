"""`lowbit eval` usage errors: one line on stderr, exit code 2, before any model is loaded."""
import sys

import pytest

from lowbit import cli


def main(argv):
    """lowbit.cli picks the subcommand module from sys.argv (not from argv): give it both."""
    old = sys.argv
    sys.argv = ["lowbit", *argv]
    try:
        return cli.main(argv)
    finally:
        sys.argv = old


@pytest.mark.parametrize("argv, message", [
    (["smollm2-135m", "--gate", "recovery>0.9", "--baseline", "smollm2-135m"], "--gate: cannot read"),
    (["smollm2-135m", "--gate", "accuracy>=0.9", "--baseline", "smollm2-135m"], "unknown gate metric"),
    (["no-such-model"], "unknown model"),
    (["smollm2-135m", "--backend", "server"], "needs --url"),
    (["smollm2-135m", "--url", "http://localhost:8000"], "only used with --backend server"),
    (["smollm2-135m", "--limit", "0"], "--limit"),
    (["smollm2-135m", "--batch", "0"], "--batch"),
    (["smollm2-135m", "--gate", "recovery>=0.9"], "pass --baseline"),
    (["smollm2-135m", "--tasks", "missing.yaml"], "does not exist"),
    (["smollm2-135m", "--baseline", "smollm2-135m", "--tasks", "arc_easy", "--gate", "kl<=0.02"], "ppl task"),
    (["smollm2-135m", "--baseline", "smollm2-135m", "--tasks", "ppl", "--gate", "recovery>=0.9"], "accuracy task"),
    (["smollm2-135m", "--baseline", "smollm2-135m", "--tasks", "ppl", "--gate", "piqa.recovery>=0.9"], "needs the task"),
    (["smollm2-135m", "--confidence", "1.5"], "--confidence"),
])
def test_usage_errors_exit_2(argv, message, capsys, embedded_model_dir):
    assert main(["eval", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and message in err and "\n" not in err


def test_argparse_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["eval", "smollm2-135m", "--backend", "grpc"])
    assert e.value.code == 2


@pytest.mark.slow
def test_unknown_task_name_exit_2(capsys, embedded_model_dir):
    assert main(["eval", "smollm2-135m", "--tasks", "arc_easy,no_such_task"]) == 2  # reads lm-eval's index (~20 s)
    assert "unknown task(s) no_such_task" in capsys.readouterr().err


def test_an_internal_failure_exits_3_not_1(tmp_path, capsys, monkeypatch, embedded_model_dir):
    """A crash inside the evaluation (here: the in-process scorer raising) is not "gate failed": exit 3, the
    traceback, then one line naming the error."""
    from lowbit.evaluate import runner

    def broken(*args, **kwargs):
        raise RuntimeError("scorer exploded")

    monkeypatch.setattr(runner, "evaluate", broken)
    assert main(["eval", "smollm2-135m", "--tasks", "ppl", "--no-cache"]) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "internal error: RuntimeError: scorer exploded (exit 3)"
    assert any(line.startswith("Traceback") for line in err)


def test_a_directory_that_is_not_a_checkpoint_exits_2(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
