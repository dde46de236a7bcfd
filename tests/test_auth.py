"""API keys as principals: the keys file, rotation, admin keys, and what a principal may see."""

from __future__ import annotations

import pytest

from megaslide.cli.main import main
from megaslide.server.auth import ANONYMOUS, Keyring, KeysFileError, Principal, digest


def test_keys_from_the_environment_and_a_keys_file(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text(
        "# name  sha256  role\n"
        f"alice  {digest('old-key')}\n"
        f"alice  {digest('new-key')}   # rotated in; old-key goes once clients moved\n"
        f"ops    {digest('ops-key')}  admin\n"
    )
    ring = Keyring(["plain-key"], keys_file)
    assert ring.enabled
    assert ring.principal("old-key") == ring.principal("new-key") == Principal("alice")
    assert ring.principal("ops-key") == Principal("ops", admin=True)
    plain = ring.principal("plain-key")
    assert plain.name.startswith("key-") and not plain.admin
    assert ring.principal("guess") is None and ring.principal("") is None
    assert not Keyring([]).enabled


@pytest.mark.parametrize(
    "line, problem",
    [
        ("alice", "expected NAME SHA256"),
        ("al ice x y", "expected NAME SHA256"),
        (f"{'a' * 65} {digest('k')}", "is not a name"),
        ("alice 1234", "SHA-256"),
        (f"alice {digest('k')} root", "role must be"),
    ],
)
def test_a_bad_keys_file_line_is_named(tmp_path, line, problem):
    keys_file = tmp_path / "keys"
    keys_file.write_text(f"# header\n{line}\n")
    with pytest.raises(KeysFileError, match=f"line 2: .*{problem}"):
        Keyring([], keys_file)


def test_what_a_principal_sees():
    alice, admin = Principal("alice"), Principal("ops", admin=True)
    assert alice.may_see("alice") and alice.may_see(None) and not alice.may_see("bob")
    assert admin.may_see("bob") and admin.sees is None and alice.sees == "alice"
    assert ANONYMOUS.may_see("bob") and ANONYMOUS.owner is None
    assert alice.scope != admin.scope != ANONYMOUS.scope


def test_the_keys_command_prints_a_key_and_its_line(capsys, tmp_path):
    assert main(["keys", "alice", "--admin"]) == 0
    out, err = capsys.readouterr()
    key = err.strip().rsplit(" ", 1)[-1]
    assert out.split() == ["alice", digest(key), "admin"]
    (tmp_path / "keys").write_text(out)
    assert Keyring([], tmp_path / "keys").principal(key) == Principal("alice", admin=True)
    assert main(["keys", "not a name"]) == 2
