"""`dptorch example NAME [flags]`: runs an example's main with its own flags."""

import json

from dptorch.cli import main


def test_runs_the_named_example_with_its_flags(capsys):
    assert main(["example", "digits", "--epochs", "1", "--epsilon", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["steps"] == 12 and report["epsilon"] <= 2.0  # 1437 images, expected batch 128


def test_the_examples_flag_errors_and_help_keep_its_exit_code(capsys):
    assert main(["example", "digits", "--no-such-flag"]) == 2
    assert "dptorch example digits: error: unrecognized arguments: --no-such-flag" in capsys.readouterr().err
    assert main(["example", "digits", "--help"]) == 0
    assert "--max-grad-norm" in capsys.readouterr().out


def test_an_unknown_example_is_one_line_naming_the_choices(capsys):
    assert main(["example", "imagenet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dptorch: error: argument NAME: invalid choice: 'imagenet'") and "'minilm'" in err
