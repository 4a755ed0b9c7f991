"""Image recipes, builds and the store.

The built-in images are built once into the persistent image store
($CORRAL_IMAGE_DIR, default /var/lib/corral/images/built) and reused by later
runs: a fresh machine pays the cold builds (about 2 min for base and 1.7 min
for python-data, see docs/images.md); later runs find them in milliseconds.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from corral import Sandbox
from corral.errors import ImageBuildFailed, InvalidSpec, ResourceLimit
from corral.host import cgroups
from corral.images import recipe as recipes
from corral.images import resolve, store
from corral.images.build import build
from corral.images.buildbox import BuildBox

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="session")
def base_image(state_dir: Path) -> store.ImageRecord:
    return build(recipes.load("base"), state_dir).record


def _leftovers() -> list[str]:
    """Staging directories of builds that are not running (other builds may run in parallel)."""
    return [p.name for p in store.leftovers(store.image_dir())]


def _build_groups() -> set[str]:
    return {name for name in cgroups.list_sandbox_groups() if name.startswith("build-")}


# -- recipes (no build) ---------------------------------------------------------
def test_recipe_rejects_bad_input(tmp_path: Path) -> None:
    cases = [
        ({"apt": ["python3; rm -rf /"]}, "apt"),
        ({"apt": "python3"}, "list"),
        ({"pip": ["requests --index-url http://evil"]}, "pip"),
        ({"surprise": 1}, "unknown key"),
        ({"suite": "sid-of-doom"}, "suite"),
        ({"files": [{"src": "nope.txt", "dest": "/etc/x"}]}, "does not exist"),
        ({"files": [{"src": "r.toml", "dest": "etc/x"}]}, "absolute"),
        ({"from": "base", "suite": "trixie"}, "keeps its suite"),
        ({"name": "Bad Name"}, "name"),
    ]
    (tmp_path / "r.toml").write_text("")
    for data, needle in cases:
        with pytest.raises(InvalidSpec, match=needle):
            recipes.parse(data, tmp_path / "r.toml")
    with pytest.raises(InvalidSpec, match="not valid TOML"):
        (tmp_path / "broken.toml").write_text("apt = [")
        recipes.load(tmp_path / "broken.toml")
    with pytest.raises(InvalidSpec, match="no built-in recipe"):
        recipes.load("no-such-recipe")


def test_a_recipes_files_come_from_its_own_directory_and_are_files(tmp_path: Path) -> None:
    """A recipe's ``files`` could name any host path: ``../../etc/shadow`` (or a link to it) put the
    host's file in an image every tenant's root could read, ``/dev/zero`` filled the image store,
    and a fifo in a copied directory hung the build for ever.  A source is now a regular file or a
    directory of files, directories and links, inside the recipe's directory."""
    context = tmp_path / "ctx"
    (context / "tree").mkdir(parents=True)
    (context / "tree" / "ok.txt").write_text("fine")
    (context / "tree" / "link").symlink_to("/etc/shadow")  # copied as a link: the image's own file
    (context / "motd").write_text("hi")
    (tmp_path / "secret").write_text("host's")
    (context / "innocent.txt").symlink_to("/etc/shadow")
    source = context / "r.toml"
    source.write_text("")
    refused = {
        "../secret": "outside the recipe's directory",
        "innocent.txt": "outside the recipe's directory",
        "/etc/shadow": "outside the recipe's directory",
        "/dev/zero": "outside the recipe's directory",
    }
    for src, needle in refused.items():
        with pytest.raises(InvalidSpec, match=needle):
            recipes.parse({"files": [{"src": src, "dest": "/etc/x"}]}, source)
    os.mkfifo(context / "pipe")
    with pytest.raises(InvalidSpec, match="not a regular file or a directory"):
        recipes.parse({"files": [{"src": "pipe", "dest": "/etc/x"}]}, source)
    os.mkfifo(context / "tree" / "fifo")
    with pytest.raises(InvalidSpec, match="not a regular file, a directory or a symlink"):
        recipes.parse({"files": [{"src": "tree", "dest": "/opt/tree"}]}, source)
    (context / "tree" / "fifo").unlink()
    # the allowed direction: a file and a directory of the recipe's own
    parsed = recipes.parse({"files": [{"src": "motd", "dest": "/etc/motd"}, {"src": "tree", "dest": "/opt/tree"}]},
                           source)
    assert [copy.dest for copy in parsed.files] == ["/etc/motd", "/opt/tree"]


def test_digest_follows_content_not_name(tmp_path: Path) -> None:
    motd = tmp_path / "motd"
    motd.write_text("hello\n")
    files = [{"src": "motd", "dest": "/etc/motd"}]
    source = tmp_path / "r.toml"
    first = recipes.parse({"name": "a", "apt": ["git", "curl"], "files": files}, source).digest()
    same = recipes.parse({"name": "b", "apt": ["curl", "git"], "files": files}, source).digest()
    assert first == same  # the name and the order of apt packages do not define the image
    assert recipes.parse({"apt": ["git"], "files": files}, source).digest() != first
    assert recipes.parse({"apt": ["git", "curl"], "files": files, "run": ["true"]}, source).digest() != first
    motd.write_text("changed\n")  # a file the recipe names changed: new image
    assert recipes.parse({"apt": ["git", "curl"], "files": files}, source).digest() != first
    python_data = recipes.load("python-data")
    assert python_data.base_image == "base" and {"python3-pandas", "python3-openpyxl"} <= set(python_data.apt)
    with pytest.raises(InvalidSpec, match="digest of image 'base' is needed"):
        python_data.digest()  # a derived image's digest includes its parent's
    assert "chromium" in recipes.load("browser").apt


def test_unknown_image_is_a_clear_error() -> None:
    with pytest.raises(InvalidSpec, match="not built"):
        Sandbox.create(image="no-such-image")


# -- built images ---------------------------------------------------------------
def test_base_has_its_packages(base_image: store.ImageRecord) -> None:
    with Sandbox.create(image="base") as sb:
        r = sb.commands.run("python3 --version && node --version && npm --version && git --version && "
                            "curl --version && test -s /etc/ssl/certs/ca-certificates.crt && id -un")
        assert r.exit_code == 0, r.stderr
        assert "Python 3." in r.stdout and "git version" in r.stdout and r.stdout.strip().endswith("user")
    assert base_image.packages > 50
    layout = resolve("base", Path("/nonexistent"))
    assert layout.own_etc and layout.layers == (("/", base_image.rootfs),)


def test_rebuild_of_unchanged_recipe_is_a_no_op(base_image: store.ImageRecord, state_dir: Path) -> None:
    again = build(recipes.load("base"), state_dir)
    assert not again.built
    assert again.record.digest == base_image.digest == recipes.load("base").digest()
    assert again.seconds < 5  # a bound for a hang, not the speed target (bench/images.py)


def test_sandbox_cannot_change_the_image(base_image: store.ImageRecord) -> None:
    before = {p: p.lstat().st_mtime_ns for p in (base_image.rootfs / "usr/bin").iterdir()}
    python = base_image.rootfs / "usr/bin/python3.11"
    python_bytes = python.read_bytes()
    with Sandbox.create(image="base") as sb:
        denied = sb.commands.run("echo x > /usr/bin/evil; rm -f /usr/bin/python3.11; echo y >> /usr/bin/python3.11; "
                                 "mkdir /usr/local/evil; ls /usr/bin/python3.11")
        assert "Permission denied" in denied.stderr
        allowed = sb.commands.run("echo ok > /tmp/t && cat /tmp/t && echo home > ~/h && cat ~/h")
        assert allowed.stdout == "ok\nhome\n"
    after = {p: p.lstat().st_mtime_ns for p in (base_image.rootfs / "usr/bin").iterdir()}
    assert before == after and python.read_bytes() == python_bytes
    assert not (base_image.rootfs / "usr/local/evil").exists()
    st = python.stat()
    assert (st.st_uid, st.st_gid) == (0, 0)


def _derived_recipe(tmp_path: Path, run: list[str], pip: list[str] | None = None,
                    npm: list[str] | None = None) -> recipes.Recipe:
    (tmp_path / "greeting.txt").write_text("hello from the recipe\n")
    run_lines = ",\n".join(f"    {cmd!r}" for cmd in run)
    pip_line = (f"pip = {pip!r}\n" if pip else "") + (f"npm = {npm!r}\n" if npm else "")
    (tmp_path / "derived.toml").write_text(textwrap.dedent(f"""\
        name = "test-derived-{os.getpid()}"
        from = "base"
        {pip_line}
        [[files]]
        src = "greeting.txt"
        dest = "/usr/local/share/greeting.txt"
        """).replace("from = \"base\"\n", f"from = \"base\"\nrun = [\n{run_lines}\n]\n"))
    return recipes.load(tmp_path / "derived.toml")


def test_build_commands_run_sandboxed_and_pip_npm_install_offline(
        base_image: store.ImageRecord, state_dir: Path, tmp_path: Path) -> None:
    recipe = _derived_recipe(tmp_path, [
        "id -u > /usr/local/share/build-uid",
        # no network inside a build step; the host's files are not there
        "(curl -sS -m 3 http://deb.debian.org/ >/dev/null 2>&1 && echo online || echo offline) > /usr/local/share/net",
        "test ! -e /work && test ! -e /var/lib/corral/images",
        "python3 -c 'import six; print(six.__version__)' > /usr/local/share/six-version",
        "semver -i minor 1.2.3 > /usr/local/share/semver-out",  # an npm CLI, fetched on the host
    ], pip=["six==1.16.0"], npm=["semver@7.6.3"])
    try:
        result = build(recipe, state_dir)
        rootfs = result.record.rootfs
        assert (rootfs / "usr/local/share/build-uid").read_text() == "0\n"
        assert (rootfs / "usr/local/share/net").read_text() == "offline\n"
        assert (rootfs / "usr/local/share/six-version").read_text() == "1.16.0\n"
        assert (rootfs / "usr/local/share/semver-out").read_text() == "1.3.0\n"
        for path in (rootfs / "usr/local/share/build-uid", rootfs / "usr/local/lib", rootfs / "usr/bin/python3.11",
                     base_image.rootfs / "usr/bin/python3.11"):
            assert (path.stat().st_uid, path.stat().st_gid) == (0, 0)  # handed back to root
        # unchanged files are the parent's inodes (no copy); what the build wrote carries no overlay xattrs
        assert (rootfs / "usr/bin/python3.11").stat().st_ino == (base_image.rootfs / "usr/bin/python3.11").stat().st_ino
        assert not [a for a in os.listxattr(rootfs / "usr/local/share/net") if a.startswith("trusted.")]
        with Sandbox.create(image=recipe.name) as sb:
            r = sb.commands.run("cat /usr/local/share/greeting.txt; python3 -c 'import six'")
            assert (r.exit_code, r.stdout) == (0, "hello from the recipe\n")
            with pytest.raises(ResourceLimit, match="in use"):
                store.remove(recipe.name)  # never pulled from under a running sandbox
            assert store.lookup(recipe.name) is not None
        assert base_image.rootfs.is_dir() and not (base_image.rootfs / "usr/local/share/greeting.txt").exists()
    finally:
        store.remove(recipe.name)
    assert store.lookup(recipe.name) is None
    assert not _leftovers() and not _build_groups()


def test_broken_recipe_fails_cleanly(base_image: store.ImageRecord, state_dir: Path, tmp_path: Path) -> None:
    recipe = _derived_recipe(tmp_path, ["echo step one > /usr/local/share/one", "echo boom >&2; exit 3"])
    uids_before = set(os.listdir(state_dir / "uids")) if (state_dir / "uids").is_dir() else set()
    with pytest.raises(ImageBuildFailed, match="run 2") as info:
        build(recipe, state_dir)
    assert info.value.step == "run 2"
    assert "boom" in Path(info.value.log_path).read_text()
    assert "boom" in str(info.value)  # the log's tail is in the message
    Path(info.value.log_path).unlink()
    assert store.lookup(recipe.name) is None
    assert store.record(store.image_dir(), recipe.digest(base_image.digest)) is None
    assert not _leftovers() and not _build_groups()
    assert set(os.listdir(state_dir / "uids")) == uids_before


def test_a_forced_rebuild_replaces_the_image_with_new_bytes(
        base_image: store.ImageRecord, state_dir: Path, tmp_path: Path) -> None:
    """`corral image build --force` of a built image always failed ("step 'finalize' failed:
    Directory not empty"): its removal took the digest's lock a second time, from the process
    already holding it, was refused and deleted nothing, so a recipe could never be rebuilt in place
    (a Debian update's new bytes under the same digest)."""
    recipe = _derived_recipe(tmp_path, ["date +%s%N > /etc/build-stamp"])
    try:
        first = build(recipe, state_dir)
        stamp = (first.record.rootfs / "etc/build-stamp").read_text()
        again = build(recipe, state_dir, force=True)
        assert again.built and again.record.digest == first.record.digest
        assert (again.record.rootfs / "etc/build-stamp").read_text() != stamp
        with Sandbox.create(image=recipe.name) as sb:
            assert sb.commands.run("cat /etc/build-stamp").stdout == (again.record.rootfs / "etc/build-stamp").read_text()
        assert not build(recipe, state_dir).built  # without --force the rebuilt image is kept
    finally:
        store.remove(recipe.name)
    assert not _leftovers() and not _build_groups()


def _replace_with(path: Path, make: str) -> None:
    """Swap an image's file for a link (``make`` its target) or, ``make`` empty, a fifo: unlinked
    first, so the parent's inode a derived image shares by a hard link is never written."""
    path.unlink()
    if make:
        path.symlink_to(make)
    else:
        os.mkfifo(path)


def test_an_images_identity_files_are_merged_and_a_link_or_fifo_there_brings_nothing_of_the_hosts(
        base_image: store.ImageRecord, state_dir: Path, tmp_path: Path) -> None:
    """Every create reads the image's ``/etc/passwd``, ``group`` and ``shadow`` on the host, as root,
    to merge the sandbox's users in. Read by name, a link a build left there was followed on the
    host: ``/etc/shadow -> ../../../../etc/shadow`` put the host's shadow in every sandbox of the
    image, and ``/etc/group`` -> a root-only 0600 host file showed it whole, 0644, to the sandbox's
    user; a fifo there hung every create for ever (helper rt138). Now they are read from a
    descriptor of the image's root, no link followed, regular files only: such a file refuses the
    create (``InvalidSpec``, naming it), and an image's ordinary files are merged as before."""
    secret_dir = tmp_path / "host-only"
    secret_dir.mkdir(mode=0o700)
    secret = secret_dir / "id_rsa"
    secret.write_text("HOST-ONLY-SECRET-of-the-test\n")
    os.chmod(secret, 0o600)
    recipe = _derived_recipe(tmp_path, [
        "echo 'svc-test:x:4242:4242:svc:/nonexistent:/usr/sbin/nologin' >> /etc/passwd"
        " && echo 'svc-test:x:4242:' >> /etc/group && echo 'svc-test:*:19000:0:99999:7:::' >> /etc/shadow"])
    try:
        rootfs = build(recipe, state_dir).record.rootfs
        # allowed: the image's own users stay and the sandbox's are added
        with Sandbox.create(image=recipe.name) as sb:
            r = sb.commands.run("getent passwd svc-test user root | cut -d: -f1,3; getent group svc-test | cut -d: -f3; id -un")
            assert (r.exit_code, r.stdout) == (0, "svc-test:4242\nuser:1000\nroot:0\n4242\nuser\n"), r
            shadow = sb.commands.run("cut -d: -f1 /etc/shadow", user="root").stdout.split()
            assert "svc-test" in shadow and "user" in shadow
        # denied: what the image's build could have left there before builds refused it (an image
        # stored by an earlier Corral), made here on the stored image itself
        depth = "../" * (len(rootfs.parts) + 2)
        for rel, make in (("etc/shadow", f"{depth}etc/shadow"), ("etc/passwd", f"{depth}etc/passwd"),
                          ("etc/group", f"{depth}{str(secret).lstrip('/')}"), ("etc/group", "")):
            original = (rootfs / rel).read_bytes()
            _replace_with(rootfs / rel, make)
            started = time.monotonic()
            with pytest.raises(InvalidSpec, match=f"its /{rel} is (a link|not a regular file)"), \
                    Sandbox.create(image=recipe.name) as sb:
                shown = sb.commands.run(f"wc -c < /{rel}", user="root").stdout.strip()
                pytest.fail(f"a sandbox was made from it; its /{rel} held {shown} bytes")
            assert time.monotonic() - started < 30
            (rootfs / rel).unlink()
            (rootfs / rel).write_bytes(original)
        with Sandbox.create(image=recipe.name) as sb:  # and the image's regular files work again
            assert sb.commands.run("getent passwd svc-test").exit_code == 0
    finally:
        store.remove(recipe.name)
    assert not _leftovers() and not _build_groups()


def test_a_build_that_leaves_a_link_or_fifo_where_the_host_reads_fails_at_finalize_in_time(
        base_image: store.ImageRecord, state_dir: Path, tmp_path: Path) -> None:
    """The host reads an image's ``/var/lib/dpkg/status`` at the build's end (its package count) and
    its ``/etc/passwd``, ``group``, ``shadow`` at every create, as root. A fifo a build step left at
    the first hung the build for ever, past its ``build_timeout`` (which bounds sandboxed steps
    only); a link at the others brought the host's file into every sandbox. Now such a build fails
    at ``finalize`` (``ImageBuildFailed``) at once, and no image is stored."""
    recipe = _derived_recipe(tmp_path, ["rm -f /etc/shadow && ln -s ../../../../../../../../../etc/shadow /etc/shadow"])
    with pytest.raises(ImageBuildFailed, match="its /etc/shadow is a link") as info:
        build(recipe, state_dir)
    assert info.value.step == "finalize"
    assert store.lookup(recipe.name) is None
    (tmp_path / "fifo.toml").write_text(textwrap.dedent(f"""\
        name = "test-fifo-{os.getpid()}"
        from = "base"
        build_timeout = 20
        run = ["rm -f /var/lib/dpkg/status && mkfifo /var/lib/dpkg/status"]
        """))
    corral = [sys.executable, "-c", "import sys; from corral.cli import main; sys.exit(main())"]
    started = time.monotonic()
    proc = subprocess.Popen([*corral, "image", "build", "-q", str(tmp_path / "fifo.toml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, err = proc.communicate(timeout=150)  # a build of one step: ~15-30 s
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("the build hung on the fifo its step left")
    assert proc.returncode != 0 and "its /var/lib/dpkg/status is not a regular file" in err, err
    assert time.monotonic() - started < 150
    assert store.lookup(f"test-fifo-{os.getpid()}") is None
    assert not _leftovers() and not _build_groups()


def test_a_link_a_parent_image_planted_leads_no_write_of_a_derived_build_outside_the_image(
        base_image: store.ImageRecord, state_dir: Path, tmp_path: Path) -> None:
    """A build writes into its image as host root what the host fetched or holds: npm's packages
    (into ``/usr/local``), the recipe's files, the empty directories host directories are bound on.
    By path, the links of a parent image (built from a hostile recipe) led those writes into the
    host: ``/usr/local/lib -> /tmp/x`` put a derived build's npm packages, root's, in the host's
    ``/tmp/x``, and a dangling ``/srv/app/conf -> /tmp/y/planted`` made a directory copy create
    the host's ``/tmp/y/planted`` (helper fx140). Now every directory is opened from a descriptor
    of the image's root, links resolving inside the image (where one leads nowhere the step fails,
    naming it), and a link at a file's name is replaced: the host directories stay empty, and
    files still reach the image through its own links (``/bin -> usr/bin``, an absolute one)."""
    npm_target, files_target, bind_target = (tmp_path / f"host-{what}" for what in ("npm", "files", "bind"))
    for target in (npm_target, files_target, bind_target):
        target.mkdir()
    (tmp_path / "app/sub").mkdir(parents=True)
    (tmp_path / "app/conf").write_text("the recipe's conf\n")
    (tmp_path / "app/sub/data").write_text("data\n")
    (tmp_path / "tool").write_text("#!/bin/sh\necho tool ran\n")
    parent, derived = f"test-planter-{os.getpid()}", f"test-planted-{os.getpid()}"
    (tmp_path / "parent.toml").write_text(textwrap.dedent(f"""\
        name = "{parent}"
        from = "base"
        run = ["rm -rf /usr/local/lib && ln -s {npm_target} /usr/local/lib && mkdir -p /srv/app && ln -s {files_target}/planted /srv/app/conf && ln -s /srv/app /opt/app-link"]
        """))
    (tmp_path / "files.toml").write_text(textwrap.dedent(f"""\
        name = "{derived}"
        from = "{parent}"
        [[files]]
        src = "app"
        dest = "/srv/app"
        [[files]]
        src = "tool"
        dest = "/opt/app-link/bin/tool"
        mode = "0755"
        [[files]]
        src = "tool"
        dest = "/bin/fx-tool"
        """))
    (tmp_path / "npm.toml").write_text(f'name = "{derived}-npm"\nfrom = "{parent}"\nnpm = ["semver@7.6.3"]\n')
    try:
        build(recipes.load(tmp_path / "parent.toml"), state_dir)
        with pytest.raises(ImageBuildFailed, match="its /usr/local/lib is a link to nothing") as info:
            build(recipes.load(tmp_path / "npm.toml"), state_dir)
        assert info.value.step == "npm fetch"
        rootfs = build(recipes.load(tmp_path / "files.toml"), state_dir).record.rootfs
        assert (rootfs / "srv/app/conf").read_text() == "the recipe's conf\n"  # the link replaced, not followed
        assert not (rootfs / "srv/app/conf").is_symlink() and (rootfs / "srv/app/conf").stat().st_uid == 0
        with Sandbox.create(image=derived) as sb:
            r = sb.commands.run("cat /srv/app/conf /srv/app/sub/data; /opt/app-link/bin/tool; sh /usr/bin/fx-tool")
            assert (r.exit_code, r.stdout) == (0, "the recipe's conf\ndata\ntool ran\ntool ran\n"), r
        # the empty directory a host directory is bound on (pip's wheels) is made without following links
        (tmp_path / "tiny").mkdir()
        (tmp_path / "tiny/.corral-build").symlink_to(bind_target)
        with pytest.raises(OSError, match="a link"):
            BuildBox(tmp_path / "tiny", state_dir, "128M", {"/.corral-build/wheels": tmp_path / "app"}).close()
    finally:
        for name in (derived, f"{derived}-npm", parent):
            if store.lookup(name) is not None:
                store.remove(name)
        for log in (store.image_dir() / "failed").glob(f"{derived}-npm-*"):
            log.unlink()  # the npm fetch step's, kept by the failure
    assert [os.listdir(target) for target in (npm_target, files_target, bind_target)] == [[], [], []]
    assert not _leftovers() and not _build_groups()


def _peak_rss_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmHWM"))


def test_a_build_steps_output_and_files_are_bounded_on_the_host(
        base_image: store.ImageRecord, state_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build step's output went to a host log without a bound (1 GB in 3 s) and a failed step's
    log was read whole: 500 MB of one line took the builder to 4.9 GB and all of it went into
    the error message; its files are the host's disk, and only the build's 30-minute timeout
    stopped a step writing them (helper 91).  A step's log keeps its first 32 MiB and its last
    64 KiB, the message a bounded tail, and a step is stopped once the host's disk is down to a
    reserve (here set 150 MiB below what was free, so as not to fill this host's disk)."""
    from corral.images import buildbox

    loud = _derived_recipe(tmp_path, ["fallocate -l 1G /usr/local/share/big || echo no-fallocate; "
                                      "head -c 100M /dev/zero | tr '\\0' B; echo; echo the-end; exit 1"])
    before = _peak_rss_mib()
    started = time.monotonic()
    with pytest.raises(ImageBuildFailed, match="exited with 1") as info:
        build(loud, state_dir)
    log = Path(info.value.log_path)
    assert buildbox.STEP_LOG_MOST < log.stat().st_size < buildbox.STEP_LOG_MOST + buildbox.STEP_LOG_TAIL + 4096
    assert "bytes of output dropped" in log.read_bytes()[-buildbox.STEP_LOG_TAIL - 4096:].decode(errors="replace")
    assert len(str(info.value)) < 16 * 1024 and "the-end" in str(info.value)
    # (fallocate took 900 MiB in 0.3 ms, before the disk could be looked at: a step has none)
    with open(log, "rb") as head:
        assert b"no-fallocate" in head.read(1 << 16)
    assert _peak_rss_mib() - before < 64, "the builder read the step's log whole"
    log.unlink()
    assert time.monotonic() - started < 120

    fs = os.statvfs(store.image_dir())
    monkeypatch.setattr(buildbox, "disk_reserve", lambda total: fs.f_bavail * fs.f_frsize - (150 << 20))
    filling = _derived_recipe(tmp_path, ["head -c 600M /dev/zero > /usr/local/share/fill; sleep 120"])
    started = time.monotonic()
    with pytest.raises(ImageBuildFailed, match="host's disk") as info:
        build(filling, state_dir)
    assert time.monotonic() - started < 60, "the step ran on past the disk's reserve"
    Path(info.value.log_path).unlink()
    assert store.lookup(filling.name) is None
    # inodes too: empty files take hardly a byte (helper 94: 308,000 in 8 s)
    monkeypatch.setattr(buildbox, "disk_reserve", lambda total: 0)
    inodes = os.statvfs(store.image_dir()).f_favail - 20_000
    monkeypatch.setattr(buildbox, "inode_reserve", lambda total: inodes)
    many = _derived_recipe(tmp_path, ["mkdir /usr/local/share/many && cd /usr/local/share/many && "
                                      "seq 60000 | xargs touch; sleep 120"])
    started = time.monotonic()
    with pytest.raises(ImageBuildFailed, match="free inodes") as info:
        build(many, state_dir)
    assert time.monotonic() - started < 60, "the step ran on past the inodes' reserve"
    Path(info.value.log_path).unlink()
    assert not _leftovers() and not _build_groups()


def test_a_set_id_file_keeps_its_bit_through_a_build_only_if_the_build_left_it_alone(
        base_image: store.ImageRecord, state_dir: Path, tmp_path: Path) -> None:
    """The build uid gets the image's root-owned files for the build (chown clears set-id bits) and
    root gets them back at its end. The set-id modes were put back by path, onto whatever file was
    there by then: a step that wrote ``/bin/id`` over ``/usr/bin/su`` left a setuid-root binary of
    its own bytes in the image store (run by ``nobody`` on the host, it printed euid=0). Now a bit
    comes back only onto the very file it was on, unchanged; the others stay cleared, said in the log."""
    recipe = _derived_recipe(tmp_path, ["cat /bin/id > /usr/bin/su", "true"])
    base = base_image.rootfs
    try:
        rootfs = build(recipe, state_dir).record.rootfs
        # denied: the step's own bytes at su's path are not setuid root
        su = (rootfs / "usr/bin/su").stat()
        assert (rootfs / "usr/bin/su").read_bytes() == (base / "usr/bin/id").read_bytes()
        assert (su.st_uid, su.st_mode & 0o7777) == (0, 0o755)
        log = (rootfs.parent / "logs" / "run-2.log").read_text()
        assert "set-id bits not restored: changed by the build: /usr/bin/su]" in log
        # allowed: files the build left alone keep their set-id bits and owners (setuid newgrp,
        # setgid-shadow unix_chkpwd; directories keep theirs through chown anyway)
        for inside, mode in (("usr/bin/newgrp", 0o4755), ("usr/sbin/unix_chkpwd", 0o2755),
                             ("var/mail", 0o2775), ("var/local", 0o2775)):
            st, parent = (rootfs / inside).stat(), (base / inside).stat()
            assert (st.st_mode & 0o7777, st.st_uid, st.st_gid) == (mode, parent.st_uid, parent.st_gid), inside
        assert (base / "usr/bin/su").stat().st_mode & 0o7777 == 0o4755  # the parent is untouched
        # and no other host user reaches a built image's files at all (sandboxes still start from it)
        assert rootfs.parent.stat().st_mode & 0o7777 == 0o700
        os.chmod(rootfs.parent, 0o711)  # as an image built before this was
        assert store.lookup(recipe.name) is not None and rootfs.parent.stat().st_mode & 0o7777 == 0o700
        # (through a shell: setpriv execs its command while it still holds root's capabilities)
        as_nobody = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/bin/sh", "-c",
                                    f"exec {rootfs / 'usr/bin/newgrp'} --help"], capture_output=True, text=True)
        assert as_nobody.returncode != 0 and "Permission denied" in as_nobody.stderr, as_nobody
        with Sandbox.create(image=recipe.name) as sb:
            r = sb.commands.run("cat /usr/local/share/greeting.txt; ls -l /usr/bin/newgrp")
            assert r.exit_code == 0 and r.stdout.startswith("hello from the recipe\n-rwsr-xr-x"), r
    finally:
        store.remove(recipe.name)
    assert not _leftovers() and not _build_groups()


def test_a_build_step_cannot_fool_the_set_id_restore_by_resetting_times(state_dir: Path) -> None:
    """BuildBox on its own, over a minimal rootfs: a same-size rewrite with its mtime set back, a
    chmod, and an untouched file. Only the untouched one gets its set-id bits back."""
    work = Path(tempfile.mkdtemp(prefix="corral-setid-"))  # not under the 0700 state directory
    os.chmod(work, 0o711)  # the build uid must reach rootfs/
    root = work / "rootfs"
    try:
        for d in ("usr/bin", "tmp", "proc", "dev"):
            (root / d).mkdir(parents=True)
        os.symlink("usr/bin", root / "bin")
        for binary in ("/bin/dash", "/bin/cat", "/bin/touch", "/bin/chmod"):
            shutil.copy2(binary, root / "usr/bin" / Path(binary).name)
            ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
            for lib in {part for line in ldd.splitlines() for part in line.split() if part.startswith("/")}:
                (root / lib.lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(lib, root / lib.lstrip("/"))
        os.symlink("dash", root / "usr/bin/sh")
        modes = {"kept": 0o4755, "kept-sgid": 0o2755, "rewritten": 0o4755, "chmodded": 0o4755}
        for name, mode in modes.items():
            (root / "usr/bin" / name).write_bytes(b"A" * 4096)
            os.chmod(root / "usr/bin" / name, mode)
        os.utime(root / "usr/bin/rewritten", (1_000_000_000, 1_000_000_000))
        os.chmod(root, 0o755)
        box = BuildBox(root, state_dir, "128M")
        try:
            log = work / "step.log"
            code, _ = box.run("touch -r /usr/bin/rewritten /tmp/ref && "
                              "printf '%4096s' '' > /usr/bin/rewritten && touch -r /tmp/ref /usr/bin/rewritten && "
                              "chmod 0755 /usr/bin/chmodded", log, 60)
            assert code == 0, log.read_text()
        finally:
            box.close()
        rewritten = (root / "usr/bin/rewritten").stat()
        assert (rewritten.st_size, rewritten.st_mtime) == (4096, 1_000_000_000)  # only ctime and bytes tell
        got = {name: (root / "usr/bin" / name).stat() for name in modes}
        assert {name: (st.st_mode & 0o7777, st.st_uid, st.st_gid) for name, st in got.items()} == {
            "kept": (0o4755, 0, 0), "kept-sgid": (0o2755, 0, 0), "rewritten": (0o755, 0, 0), "chmodded": (0o755, 0, 0)}
        assert box.setid_dropped == ["/usr/bin/chmodded", "/usr/bin/rewritten"]
        assert "set-id bits not restored: changed by the build: /usr/bin/chmodded /usr/bin/rewritten]" \
            in log.read_text()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_killed_build_leaves_nothing_after_gc(base_image: store.ImageRecord, tmp_path: Path) -> None:
    recipe = _derived_recipe(tmp_path, ["sleep 600"])
    script = f"from corral.images import recipe, build; build.build(recipe.load({str(tmp_path / 'derived.toml')!r}), " \
             f"__import__('pathlib').Path({os.environ['CORRAL_STATE_DIR']!r}))"
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _build_groups() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert _build_groups(), "the build never reached its sandboxed step"
        os.killpg(proc.pid, signal.SIGKILL)  # no cleanup code runs
        proc.wait()
        left = _leftovers()
        assert left
        janitor = [str(Path(sys.executable).with_name("corral")), "gc"]
        subprocess.run(janitor, check=True, capture_output=True, timeout=120)
        assert _leftovers() == left  # fresh: another build may not have locked it yet
        old = time.time() - 2 * store.STALE_BUILD_AGE
        for name in left:
            os.utime(store.image_dir() / name, (old, old))
        gone = subprocess.run(janitor, check=True, capture_output=True, text=True, timeout=120)
        assert "removed 1 stale image build directory" in gone.stdout  # once stale
        assert not _leftovers() and not _build_groups()
        store.prune()
        assert store.lookup(recipe.name) is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_image_cli(base_image: store.ImageRecord) -> None:
    corral = [sys.executable, "-c", "import sys; from corral.cli import main; sys.exit(main())"]
    built = subprocess.run([*corral, "image", "build", "-q", "base"], capture_output=True, text=True, timeout=60)
    assert built.returncode == 0 and "base up to date: " + base_image.digest[:19] in built.stdout
    listing = subprocess.run([*corral, "image", "ls"], capture_output=True, text=True, timeout=60)
    row = next(line for line in listing.stdout.splitlines() if line.startswith("base "))
    assert base_image.digest[:19] in row
    missing = subprocess.run([*corral, "image", "rm", "no-such-image"], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 125 and "no built image 'no-such-image'" in missing.stderr
    bad = subprocess.run([*corral, "image", "build", "no-such-recipe"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 125 and "no built-in recipe" in bad.stderr


def test_interrupted_build_cleans_up_by_itself(base_image: store.ImageRecord, tmp_path: Path) -> None:
    recipe = _derived_recipe(tmp_path, ["sleep 600"])
    corral = [sys.executable, "-c", "import sys; from corral.cli import main; sys.exit(main())"]
    proc = subprocess.Popen([*corral, "image", "build", "-q", str(tmp_path / "derived.toml")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not _build_groups() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert _build_groups(), "the build never reached its sandboxed step"
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)  # like Ctrl-C: the builder cleans up before exiting
        assert proc.wait(timeout=60) == 130
        assert not _leftovers() and not _build_groups()
        assert not [p for p in store.image_dir().iterdir() if p.name.startswith(".build-")
                    and recipe.digest(base_image.digest).removeprefix("sha256:").startswith(p.name.split("-")[1])]
        assert store.lookup(recipe.name) is None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
