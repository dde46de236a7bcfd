"""The CLI's remote mode (`generate --server`, `finetune --server`): dataset packing and option
checks here; runs against a real server are in test_client_server.py."""

from __future__ import annotations

import tarfile

import pytest

from megaslide.cli.args import UsageError
from megaslide.cli.main import main as cli_main
from megaslide.cli.remote import pack_dataset


def test_pack_dataset_names_members_relative_and_follows_links(tmp_path):
    data = tmp_path / "data"
    (data / "clips").mkdir(parents=True)
    (data / "clips" / "b.mp4").write_bytes(b"bbb")
    (data / "metadata.jsonl").write_text('{"file": "clips/b.mp4", "caption": "x"}\n')
    elsewhere = tmp_path / "elsewhere.mp4"
    elsewhere.write_bytes(b"linked clip")
    (data / "clips" / "a.mp4").symlink_to(elsewhere)
    archive = tmp_path / "data.tar.gz"
    assert pack_dataset(data, archive) == 3
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == ["clips/a.mp4", "clips/b.mp4", "metadata.jsonl"]
        assert all(m.isfile() for m in members)
        assert tar.extractfile("clips/a.mp4").read() == b"linked clip"


def test_pack_dataset_refuses_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no files"):
        pack_dataset(tmp_path / "empty", tmp_path / "x.tar.gz")


@pytest.mark.parametrize(
    "command, option",
    [
        ("generate", "--offload stream"),
        ("generate", "--device cuda"),
        ("generate", "--stats s.json"),
        ("finetune", "--resume"),
        ("finetune", "--steps 3"),
        ("finetune", "--output run"),
        ("finetune", "--epochs 1.5"),
    ],
)
def test_local_only_options_are_refused_with_server(command, option, tmp_path, capsys):
    """Nothing is sent: the check comes before any request (port 1 has no server anyway)."""
    (tmp_path / "data").mkdir()
    head = (
        ["generate", "x", "-o", str(tmp_path / "o.mp4")]
        if command == "generate"
        else ["finetune", "--data", str(tmp_path / "data")]
    )
    assert cli_main(head + option.split() + ["--server", "http://127.0.0.1:1"]) == 2
    assert option.split()[0] in capsys.readouterr().err


def test_bucket_options_go_to_the_server_as_hyperparameters():
    from megaslide.cli.main import build_parser
    from megaslide.cli.remote import _hyperparameters

    flags = [
        "finetune",
        "--data",
        "d",
        "--server",
        "http://x",
        "--buckets",
        "--token-budget",
        "500",
    ]
    assert _hyperparameters(build_parser().parse_args(flags)) == {
        "buckets": True,
        "token_budget": 500,
    } | _hyperparameters(build_parser().parse_args(flags[:5]))
    assert (
        _hyperparameters(build_parser().parse_args([*flags[:5], "--no-buckets"]))["buckets"]
        is False
    )


def test_validation_options_go_to_the_server_with_the_job():
    from megaslide.cli.main import build_parser
    from megaslide.cli.remote import _hyperparameters, _validation

    flags = ["finetune", "--data", "d", "--server", "http://x"]
    args = build_parser().parse_args(flags)
    assert _validation(args) is None and "validation_split" not in _hyperparameters(args)
    more = [
        "--validation-prompt",
        "a cat",
        "--validation-prompt",
        "a dog",
        "--validation-size",
        "32x32",
        "--validation-steps",
        "2",
        "--validation-split",
        "0.1",
    ]
    args = build_parser().parse_args(flags + more)
    assert _hyperparameters(args)["validation_split"] == 0.1
    assert _validation(args) == [
        {"prompt": p, "seed": 0, "size": "32x32", "num_inference_steps": 2}
        for p in ("a cat", "a dog")
    ]
