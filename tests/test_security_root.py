"""The shared root's own mode: who may rename or plant entries beside a scope's folder.

A world-writable root without the sticky bit let another user rename a scope's
folder aside: engines holding the old account kept granting from it while new
ones created another, and a 1 GiB budget granted 2 GiB. A set-group-id root gave
a folder any user created in it the scope's group, so a non-member's folder was
trusted. Each attack is tried as a second local user would (``tests.other_user``).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvelastic.cluster import SharedAccount
from kvelastic.cluster.errors import AccountVanished
from kvelastic.cluster.membership import Membership
from kvelastic.shared.errors import UnsafeSharedPath
from tests.other_user import OTHER_UID, THIRD_UID, as_user, env_with, needs_root, shared_root  # noqa: F401

GPU = "GPU-root"
GIB = 1024**3
GROUP = 54331
JOIN_AND_TAKE = """
import sys
from kvelastic.cluster import SharedAccount
member = SharedAccount.open(sys.argv[1], 1024**3).join(sys.argv[2])
print("granted" if member.acquire(600 * 1024**2) else "refused", flush=True)
"""


def _engine(root, name: str) -> str:
    """Another engine of the same user, in its own process: it joins GPU's account and asks for 600 MiB."""
    done = subprocess.run([sys.executable, "-c", JOIN_AND_TAKE, GPU, name], capture_output=True, text=True,
                          timeout=60, env=env_with(root))
    return done.stdout.strip() or done.stderr.strip().splitlines()[-1]


def _rename_aside(folder: str) -> str:
    os.rename(folder, folder + "-aside")
    return "renamed"


@needs_root
def test_a_root_others_may_write_without_the_sticky_bit_is_refused_so_no_rename_splits_an_account(shared_root):
    shared_root.chmod(0o777)  # as an administrator might make a shared scratch folder
    errors, granted = [], 0
    try:
        account = SharedAccount.open(GPU, GIB)
        member = account.join("first")
        granted += 600 * 1024**2 if member.acquire(600 * 1024**2) else 0
        # The attack: another user renames this user's folder aside; the next engine creates a new account.
        assert as_user(_rename_aside, str(account.path.parent)) == "renamed"
        granted += 600 * 1024**2 if _engine(shared_root, "second") == "granted" else 0
    except UnsafeSharedPath as error:
        errors.append(error)
    assert granted <= GIB, "a rename split the account: more granted than the budget"
    assert len(errors) == 1 and "sticky" in str(errors[0]) and "chmod +t" in str(errors[0])


@needs_root
def test_a_root_with_the_sticky_bit_or_only_its_owner_writing_is_accepted(shared_root, tmp_path):
    for mode in (0o1777, 0o755, 0o700):
        shared_root.chmod(mode)
        with SharedAccount.open(GPU, GIB) as account:
            account.join("fine").leave()
    shared_root.chmod(0o1777)


def _make_group_folder(root: str, gid: int) -> str:
    """A non-member's folder in a set-group-id root: it inherits the group and the set-group-id bit (a chmod
    would clear the bit, the maker being no member), and so looks exactly like the group's own."""
    folder = os.path.join(root, f"kvelastic-g{gid}")
    os.umask(0)
    os.mkdir(folder, 0o770)
    st = os.stat(folder)
    return f"{st.st_gid} {st.st_mode & 0o7777:o}"


def _open_group_account(gpu: str) -> str:
    try:
        with SharedAccount.open(gpu, 40 * GIB) as account:
            account.join("team-engine")
            return "used"
    except UnsafeSharedPath as error:
        return f"refused: {error}"


@needs_root
def test_a_non_members_folder_in_a_set_group_id_root_is_not_trusted(shared_root, monkeypatch):
    os.chown(shared_root, 0, GROUP)
    shared_root.chmod(0o3777)  # set-group-id: every entry created in it gets GROUP
    made = as_user(_make_group_folder, str(shared_root), GROUP)  # OTHER_UID is not in GROUP
    assert made == f"{GROUP} 2770"  # the group's gid and mode, although its maker is no member
    monkeypatch.setenv("KVELASTIC_SHARED_GROUP", str(GROUP))
    answer = as_user(_open_group_account, GPU, uid=THIRD_UID, gid=THIRD_UID, groups=(GROUP,))  # a member
    assert answer.startswith("refused") and "set-group-id" in answer, answer


@needs_root
def test_a_group_folder_made_by_someone_the_group_does_not_list_is_refused(shared_root, monkeypatch):
    """Not set-group-id: OTHER_UID made the folder while a member; the group database does not list it now."""
    created_gid = as_user(_make_group_folder_as_member, str(shared_root), GROUP, uid=OTHER_UID, gid=OTHER_UID,
                          groups=(GROUP,))
    assert created_gid == str(GROUP)
    monkeypatch.setenv("KVELASTIC_SHARED_GROUP", str(GROUP))
    answer = as_user(_open_group_account, GPU, uid=THIRD_UID, gid=THIRD_UID, groups=(GROUP,))
    assert answer.startswith("refused") and f"uid {OTHER_UID}, not a member of group {GROUP}" in answer, answer


def _make_group_folder_as_member(root: str, gid: int) -> str:
    folder = os.path.join(root, f"kvelastic-g{gid}")
    os.mkdir(folder)
    os.chown(folder, -1, gid)  # allowed: a member may give its folder the group
    os.chmod(folder, 0o2770)
    return f"{os.stat(folder).st_gid}"


def test_an_account_renamed_aside_is_noticed_and_its_engines_rejoin_the_one_at_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("KVELASTIC_SHARED_DIR", str(tmp_path))
    first = Membership("first", lambda: SharedAccount.open(GPU, GIB).join("first"), rejoin_period_s=0.0)
    assert first.request(600 * 1024**2).granted
    held = first.member
    old = held.account.path
    os.rename(old.parent, str(old.parent) + "-aside")  # a `mv` of the folder, say
    with SharedAccount.open(GPU, GIB) as fresh:  # the next engine creates a new account at the path
        second = fresh.join("second")
        assert second.acquire(600 * 1024**2)
        with pytest.raises(AccountVanished, match="renamed"):
            held.acquire(1)  # the engine holding the old file must not grant from it
        assert first.request(600 * 1024**2) is None  # noticed: the old file is no account any more
        assert first.rejoin(600 * 1024**2)  # joins the account at the path with what it holds
        assert first.request(1).granted is False  # one account again: the budget counts both
        assert {m.name: m.mapped_bytes for m in fresh.members()} == {"first": 600 * 1024**2,
                                                                     "second": 600 * 1024**2}
        first.leave()
        second.leave()
