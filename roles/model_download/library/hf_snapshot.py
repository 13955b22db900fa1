#!/usr/bin/python
# Copyright: vllm-fleet contributors
# Apache-2.0
"""Ansible module: a Hugging Face Hub snapshot, downloaded once and proved complete."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: hf_snapshot
short_description: Download a Hugging Face Hub repo at a pinned commit and prove it byte for byte
description:
  - Resolves O(revision) (branch, tag or sha) to a commit sha, lists the repo tree at that sha
    and compares it with the files in O(local_dir) and the manifest in O(state_dir).
  - Validates every name of the listing before anything is written or deleted (relative, no
    C(..) segment, no absolute path, no backslash or NUL, resolving inside O(local_dir) even
    through symlinked parents); one bad name fails the run naming it.
  - Before fetching a byte, compares the free space of O(local_dir) with the bytes still
    to fetch plus O(space_margin_bytes) and fails with both numbers when short.
  - Fetches only missing or damaged files (a HEAD through the huggingface_hub library for
    each file's metadata and location, then one GET, O(max_workers) in parallel) into
    C(state_dir/partial/), resuming a partial file from its bytes with an HTTP Range
    request. The body is read by Python's http.client into one reused buffer (a fifth of
    the library's CPU per byte), transient failures (connection lost, 429, 5xx) resume by
    Range up to 5 times; behind a proxy (C(HTTPS_PROXY) etc.) the library's own GET is
    used. Each file's digest (sha256 for LFS files, git
    blob sha1 otherwise) is computed from the bytes as they arrive, resumed bytes included,
    and must equal the listing's before the file is moved into place; a mismatch is dropped
    and fetched once more, then the run fails naming both digests.
  - Removes files an earlier download recorded that the commit lacks; refuses (deletes
    nothing) when the directory holds files no download recorded.
  - Proves completeness (every listed file with its size and a proved digest, nothing else
    in the directory, every shard of C(model.safetensors.index.json) listed) and writes a
    manifest (size, digest, stat stamp per file) so a rerun proves "unchanged" from
    one stat call per file and re-hashes only files whose stamp moved.
  - >-
    Writes C(progress.json) in O(state_dir) once a second (files and bytes done, rate), for
    an C(async) task to be polled. Holds an flock on C(state_dir/download.lock) while it
    downloads: the kernel releases it if the process dies, so no lock goes stale.
  - The token reaches the library through this process's environment (C(HF_TOKEN)), never
    argv; O(token) is C(no_log).
version_added: "0.1.0"
author: vllm-fleet contributors
requirements:
  - huggingface_hub >= 2.4 on the interpreter that runs the module
options:
  mode:
    description:
      - V(plan) reports what a download would do and fails if space is short (read-only).
      - V(download) makes O(local_dir) complete.
      - V(verify) checks this host's view of O(local_dir) against the manifest, offline.
      - V(wait) waits up to O(wait_s) for a running download job (its C(progress.json))
        to end and returns its progress; for following a job started by O(start) (or an
        C(async) download).
    type: str
    choices: [plan, download, verify, wait]
    default: download
  repo_id:
    description: Hub repo, C(org/name).
    type: str
    required: true
  revision:
    description: Branch, tag or 40-hex commit sha.
    type: str
    default: main
  local_dir:
    description: The checkpoint directory. Nothing but repo files is written into it.
    type: path
    required: true
  state_dir:
    description: Bookkeeping directory beside the checkpoint (manifest, progress, lock, partials).
    type: path
    required: true
  endpoint:
    description: Hub endpoint (C(HF_ENDPOINT)); empty for the public hub.
    type: str
    default: ""
  token:
    description: Hub token, passed to the library by environment.
    type: str
    default: ""
  include:
    description: Glob patterns of files to download (all when empty).
    type: list
    elements: str
    default: []
  exclude:
    description: Glob patterns of files to skip.
    type: list
    elements: str
    default: []
  max_workers:
    description: Files downloaded in parallel.
    type: int
    default: 8
  verify:
    description:
      - V(digest) trusts a file only with its recorded digest and unchanged stat stamp, and
        re-hashes every other file against the listing.
      - V(full) re-hashes every file (download, plan) or every file against the manifest
        (mode V(verify)), in O(hash_workers) parallel, naming each bad file.
    type: str
    choices: [digest, full]
    default: digest
  transport:
    description:
      - V(http) plain HTTP with Range resume (sets C(HF_HUB_DISABLE_XET)).
      - V(xet) huggingface_hub's Xet path for files the hub serves through Xet (fails when
        hf_xet is not installed); each file is hashed as it lands.
      - V(auto) Xet where the hub advertises it and hf_xet is installed, else HTTP.
    type: str
    choices: [auto, http, xet]
    default: auto
  quick:
    description:
      - For V(plan), report files whose stamp moved as unproven instead of hashing them
        (the download that follows hashes them once).
    type: bool
    default: false
  hub_version:
    description:
      - For V(plan), the huggingface_hub version the interpreter must have. When its
        installed version (read from package metadata, without importing it) differs,
        the module plans nothing and returns RV(hub_ready=false) with the version found,
        so one module run both checks the toolkit venv and plans. Empty skips the check.
    type: str
    default: ""
  hash_workers:
    description: Files hashed in parallel.
    type: int
    default: 4
  space_margin_bytes:
    description: Free space to keep beyond the bytes still to fetch.
    type: int
    default: 1073741824
  lock_timeout:
    description: Seconds to wait for another download of the same directory.
    type: int
    default: 3600
  update:
    description:
      - When the branch now points to another commit than the recorded one, move to it.
        By default the recorded commit is kept, so remote code cannot change under a running fleet.
    type: bool
    default: false
  start:
    description:
      - For V(plan) outside check mode, when the checkpoint is not complete and recorded,
        start the download (mode V(download), with these options) as a detached job and
        return its RV(results_file); one module run plans and starts. Follow it with
        V(wait).
      - For V(plan) in check mode with O(verify=full), the plan itself (which hashes every
        file) runs as the job instead, its results and progress in a private temp dir
        (removed when V(wait) reads its end), never in O(state_dir); V(wait)'s RV(job) is
        then the plan's result, and RV(check_job) is V(true).
    type: bool
    default: false
  job_timeout:
    description: Seconds a job started by O(start) may run before it is ended as failed.
    type: int
    default: 86400
  wait_s:
    description: Seconds V(wait) waits for the download job to end.
    type: int
    default: 10
  job_file:
    description:
      - For V(wait), the RV(results_file) of a job started by O(start); the job has ended
        once its final result is there, or its process is gone (reported as failed).
        Without it, C(progress.json) decides.
    type: path
  chunk_bytes:
    description: Bytes per read/write; a killed run loses at most this much per file.
    type: int
    default: 1048576
notes:
  - Check mode runs V(plan). Diff mode lists the files that would be fetched.
"""

EXAMPLES = r"""
- name: Download the checkpoint once, verifying every hash
  hf_snapshot:
    repo_id: nvidia/Kimi-K2.5-NVFP4
    revision: main
    local_dir: /shared/models/kimi
    state_dir: /shared/models/.vllm-fleet/kimi
    token: "{{ vllm_fleet_hf_token }}"

- name: Plan, and start the download in the background when anything is missing
  hf_snapshot:
    mode: plan
    start: true
    repo_id: nvidia/Kimi-K2.5-NVFP4
    local_dir: /shared/models/kimi
    state_dir: /shared/models/.vllm-fleet/kimi
  register: plan

- name: Follow the download job, one line of progress per round
  hf_snapshot:
    mode: wait
    repo_id: nvidia/Kimi-K2.5-NVFP4
    local_dir: /shared/models/kimi
    state_dir: /shared/models/.vllm-fleet/kimi
    wait_s: 10
    job_file: "{{ plan.results_file }}"
  register: wait
  until: wait.ended
  retries: 8640
  delay: 0
  when: plan.started | default(false)
"""

RETURN = r"""
changed:
  description: Whether any file was fetched (download) or would be (plan).
  returned: always
  type: bool
sha:
  description: The commit sha the revision resolved to, used for every file.
  returned: always
  type: str
  sample: 9a5f0c1e2b3d4f5a6b7c8d9e0f1a2b3c4d5e6f7a
complete:
  description: Whether the checkpoint is complete (after the download, or already for plan).
  returned: always
  type: bool
files_total:
  description: Files in the (filtered) tree listing.
  returned: always
  type: int
bytes_total:
  description: Bytes in the (filtered) tree listing.
  returned: always
  type: int
files_to_fetch:
  description: Files missing or damaged before this run.
  returned: mode is plan or download
  type: int
bytes_to_fetch:
  description: Bytes of those files.
  returned: mode is plan or download
  type: int
partial_bytes:
  description: Bytes already present in partial files from an interrupted run.
  returned: mode is plan or download
  type: int
free_bytes:
  description: Free bytes on the checkpoint's filesystem before the run.
  returned: mode is plan or download
  type: int
missing:
  description: Up to 50 missing files.
  returned: mode is plan or download
  type: list
  elements: str
damaged:
  description: Files present with a wrong size or digest (re-fetched by download).
  returned: mode is plan or download
  type: list
  elements: str
unproven:
  description: Files whose stamp moved, left unhashed by a O(quick) plan.
  returned: mode is plan or download
  type: int
extra:
  description: Up to 50 recorded files the commit lacks (removed by download).
  returned: mode is plan or download
  type: list
  elements: str
hashed:
  description: Files hashed to prove them (stamp moved, no record, or O(verify=full)).
  returned: mode is plan or download
  type: int
removed:
  description: Files of an earlier commit removed by this run.
  returned: mode is download
  type: list
  elements: str
strays:
  description:
    - With O(verify=full), files in O(local_dir) that the listing lacks and no download
      recorded (without it such files fail the run). A download moves them aside.
  returned: mode is plan or download
  type: list
  elements: str
findings:
  description:
    - With O(verify=full), one record per bad file, for a report of what was wrong.
    - Keys path, problem (content, truncated, size, missing, extra), algorithm (sha256,
      git-sha1), expected_digest, actual_digest, expected_size, actual_size.
  returned: mode is plan or download
  type: list
  elements: dict
set_aside:
  description: The RV(strays) this run moved out of O(local_dir) into RV(set_aside_dir).
  returned: mode is download
  type: list
  elements: str
set_aside_dir:
  description:
    - Where the RV(strays) now are, C(state_dir/set-aside/<sha12>-<ns>/); V(null) when none.
    - Moved, not deleted (nobody recorded them); not left (vLLM would load a stray shard).
  returned: mode is download
  type: str
transports:
  description: Transports used for the fetched files (http, xet).
  returned: mode is download
  type: list
  elements: str
notes:
  description: Remarks, e.g. a branch that moved while the recorded commit is kept.
  returned: mode is plan or download
  type: list
  elements: str
fetched:
  description: Files fetched by this run.
  returned: mode is download
  type: list
  elements: str
fetched_bytes:
  description: Bytes received by this run.
  returned: mode is download
  type: int
resumed:
  description: Files resumed from partial bytes of an interrupted run.
  returned: mode is download
  type: list
  elements: str
verified:
  description: V(digest) (download; every file's digest proved) or the O(verify) of mode V(verify).
  returned: mode is download or verify
  type: str
elapsed_s:
  description: Seconds spent (hashing included).
  returned: mode is plan or download
  type: float
rate_bytes_per_s:
  description: Average download rate of this run.
  returned: mode is download
  type: int
ended:
  description: Whether the followed download job has ended (done, failed or killed).
  returned: mode is wait
  type: bool
progress:
  description:
    - The job's latest progress, from C(progress.json).
    - Keys files_done, files_total, bytes_done, bytes_total, rate_bytes_per_s, eta_s, state.
  returned: mode is wait
  type: dict
job:
  description: The download job's final result (as async_status would return it), once ended.
  returned: mode is wait and the job has ended
  type: dict
msg:
  description: The progress as one line.
  returned: mode is wait
  type: str
vllm_fleet_poll:
  description: The same line, which the project's stdout callback prints at every retry of a wait.
  returned: mode is wait
  type: str
manifest:
  description: Path of the manifest.
  returned: mode is download
  type: str
started:
  description: Whether this run started a download job (O(start)).
  returned: mode is plan and a job was started
  type: bool
results_file:
  description: The started job's results file, for V(wait)'s O(job_file).
  returned: mode is plan and a job was started
  type: str
  sample: /shared/models/.vllm-fleet/kimi/jobs/1764612000000000000-4242.json
check_job:
  description: Whether the started job is check mode's full verify (the plan), not a download.
  returned: mode is plan in check mode with O(verify=full) and O(start)
  type: bool
hub_ready:
  description: Whether the interpreter has O(hub_version) (V(true) when not asked).
  type: bool
  returned: mode is plan
hub_version:
  description: The huggingface_hub version installed on the interpreter, V(null) when none.
  type: str
  returned: mode is plan and O(hub_version) is set
"""

import functools
import time

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.hf_download import (
    DownloadError,
    Options,
    check_space,
    download,
    make_plan,
    plan_summary,
    setup_environment,
    start_check_job,
    start_job,
    verify_local,
    wait_progress,
)


def build_options(params: dict) -> Options:
    return Options(
        repo_id=params["repo_id"],
        revision=params["revision"],
        local_dir=params["local_dir"],
        state_dir=params["state_dir"],
        endpoint=params["endpoint"] or None,
        token=params["token"] or None,
        allow_patterns=params["include"] or None,
        ignore_patterns=params["exclude"] or None,
        max_workers=params["max_workers"],
        verify=params["verify"],
        hash_workers=params["hash_workers"],
        space_margin_bytes=params["space_margin_bytes"],
        lock_timeout=params["lock_timeout"],
        update=params["update"],
        chunk_bytes=params["chunk_bytes"],
        transport=params["transport"],
        quick=params["quick"],
    )


def plan_result(opts: Options, diff: bool, report_hashing: bool = False) -> dict:
    started = time.monotonic()
    plan = make_plan(opts, report_hashing)
    check_space(opts, plan)
    result = plan_summary(plan)
    result["elapsed_s"] = round(time.monotonic() - started, 2)
    result["changed"] = not plan.complete
    if diff and not plan.complete:
        todo = [f"{e.path} ({plan.status[e.path]})" for e in plan.to_fetch]
        result["diff"] = {
            "before": "".join(f"{line}\n" for line in todo),
            "after": f"{len(plan.entries)} files complete at {plan.sha}\n",
        }
    return result


def check_job_wanted(module: AnsibleModule, opts: Options) -> bool:
    """Check mode's full verify hashes every file: in a followed job, so its progress shows."""
    params = module.params
    planning = params["mode"] == "plan" and params["start"]
    return module.check_mode and planning and opts.verify == "full"


def installed_hub_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("huggingface_hub")
    except PackageNotFoundError:
        return None


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "mode": {
                "type": "str",
                "choices": ["plan", "download", "verify", "wait"],
                "default": "download",
            },
            "repo_id": {"type": "str", "required": True},
            "revision": {"type": "str", "default": "main"},
            "local_dir": {"type": "path", "required": True},
            "state_dir": {"type": "path", "required": True},
            "endpoint": {"type": "str", "default": ""},
            "token": {"type": "str", "default": "", "no_log": True},
            "include": {"type": "list", "elements": "str", "default": []},
            "exclude": {"type": "list", "elements": "str", "default": []},
            "max_workers": {"type": "int", "default": 8},
            "verify": {"type": "str", "choices": ["digest", "full"], "default": "digest"},
            "transport": {"type": "str", "choices": ["auto", "http", "xet"], "default": "auto"},
            "quick": {"type": "bool", "default": False},
            "hub_version": {"type": "str", "default": ""},
            "hash_workers": {"type": "int", "default": 4},
            "space_margin_bytes": {"type": "int", "default": 1 << 30},
            "lock_timeout": {"type": "int", "default": 3600},
            "update": {"type": "bool", "default": False},
            "chunk_bytes": {"type": "int", "default": 1 << 20},
            "start": {"type": "bool", "default": False},
            "job_timeout": {"type": "int", "default": 86400},
            "wait_s": {"type": "int", "default": 10},
            "job_file": {"type": "path"},
        },
        supports_check_mode=True,
    )
    opts = build_options(module.params)
    setup_environment(opts)
    mode = module.params["mode"]
    wanted = module.params["hub_version"]
    found = installed_hub_version() if wanted else None
    if (mode == "plan" or module.check_mode) and wanted and found != wanted:
        module.exit_json(changed=False, hub_ready=False, hub_version=found)
    try:
        if mode == "verify":
            result = verify_local(opts)
        elif mode == "wait":
            result = wait_progress(opts, module.params["wait_s"], module.params["job_file"])
        elif check_job_wanted(module, opts):
            work = functools.partial(plan_result, diff=module._diff, report_hashing=True)
            result = start_check_job(opts, module.params["job_timeout"], work)
            result["hub_ready"] = True
        elif mode == "plan" or module.check_mode:
            result = plan_result(opts, module._diff)
            result["hub_ready"] = True
            todo = not (result["complete"] and result["recorded"])
            if module.params["start"] and todo and not module.check_mode:
                result.update(start_job(opts, module.params["job_timeout"]))
            if wanted:
                result["hub_version"] = found
        else:
            result = download(opts)
    except DownloadError as err:
        module.fail_json(msg=str(err))
    except ImportError as err:
        module.fail_json(msg=f"huggingface_hub is missing on {module._name}'s interpreter: {err}")
    module.exit_json(**result)


if __name__ == "__main__":
    main()
