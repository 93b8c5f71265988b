"""loopline's recipe for an E2B template whose verifier the agent's code cannot rule.

E2B's own template build ends with a finalize step (its infra repository's `configure.sh`, after every step of
the template's own) that adds `user` to the sudo group with `NOPASSWD: ALL`, empties root's and user's passwords
and runs `chmod -R 777 /usr/local`. A verifier runs as root beside the agent's code under test, so in such a
sandbox that code can become root (sudo, `su` to a root without a password) or plant a program root will run
(`/usr/local/bin/python3`, a `.pth` in Python's site directory): a wrong solution then scores 1.0. The recipe
undoes that in the template's start command, which E2B runs as the user last set (root here) after the
finalize step, before it snapshots the sandbox every new one resumes from. The E2B backend probes each
verifier sandbox for what `HARDEN` removes (`sandbox/e2b.PROBE`) and refuses a template that still has it.
"""

from __future__ import annotations

import shlex

HARDENED = "/etc/loopline-hardened"  # written last: the template's ready check
DEFAULT_BASE = "python:3.11-slim-bookworm"

HARDEN = f"""set -eu
# No way to root for the agent's user: no sudo rule without a password, no admin group, a locked root password.
if [ -f /etc/sudoers ]; then sed -i '/NOPASSWD/d' /etc/sudoers; fi
rm -f /etc/sudoers.d/*
for group in sudo wheel admin; do gpasswd -d user "$group" >/dev/null 2>&1 || true; done
passwd -l root >/dev/null
# No program that changes its user's identity.
find / -xdev \\( -perm -4000 -o -perm -2000 \\) -type f -exec chmod ug-s {{}} +
# What root runs is root's, and only root writes it.
for d in /usr /etc /opt /bin /sbin /lib /lib32 /lib64 /libx32 /root; do
  if [ -d "$d" ] && [ ! -L "$d" ]; then
    find "$d" -xdev ! -user root ! -type l -exec chown root:root {{}} +
    find "$d" -xdev -perm /022 ! -type l -exec chmod go-w {{}} +
  fi
done
touch {HARDENED}
"""


def template(base_image: str = DEFAULT_BASE):
    """The recipe as an `e2b.Template`: `base_image` (it needs python3 for the examples' verifiers, and util-linux:
    setpriv, choom, prlimit), hardened by its start command as root."""
    from e2b import Template

    return (
        Template()
        .from_image(base_image)
        .set_user("root")
        .set_start_cmd(f"sh -c {shlex.quote(HARDEN)}", f"test -f {HARDENED}")
    )


def build(name: str, base_image: str = DEFAULT_BASE, on_log=None):
    """Build the recipe as template `name` on E2B (E2B_API_KEY); what `envreg e2b-template build` runs."""
    from e2b import Template

    return Template.build(template(base_image), name, on_build_logs=on_log)
