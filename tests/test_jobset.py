"""The Kubernetes manifests, validated offline: launch/k8s/jobset.yaml and hetjax-job.yaml.

No cluster here. Core objects (Job, Service, PersistentVolumeClaim, and each
JobSet pool's Job template) are checked against Kubernetes' own schemas in
strict mode (kubernetes-validate: an unknown field is an error, where a real
API server would drop it silently); the JobSet itself against the JobSet
CRD's schema (tests/data, from kubernetes-sigs/jobset), made strict the same
way. Then what the pods would see is checked with `hetjax.cluster.runtime.resolve`,
the function that reads it in a real pod; the container's own shell line
computes each pod's host id here. Nothing here has run on a real cluster.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import jsonschema
import kubernetes_validate
import pytest
import yaml

from hetjax import exits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOBSET = os.path.join(ROOT, "launch", "k8s", "jobset.yaml")
INDEXED_JOB = os.path.join(ROOT, "launch", "k8s", "hetjax-job.yaml")
JOBSET_SCHEMA = os.path.join(ROOT, "tests", "data", "jobset-v1alpha2-schema.json")
K8S_VERSION = "1.31"  # Indexed Jobs with pod failure policies are GA since 1.31.


def _docs(path: str) -> dict:
  with open(path) as f:
    return {d["kind"]: d for d in yaml.safe_load_all(f) if d}


def _strict(schema):
  """The schema with unknown fields refused wherever it lists the known ones."""
  schema = copy.deepcopy(schema)

  def walk(node):
    if isinstance(node, dict):
      if ("properties" in node and "additionalProperties" not in node
          and not node.get("x-kubernetes-preserve-unknown-fields")):
        node["additionalProperties"] = False
      for value in node.values():
        walk(value)
    elif isinstance(node, list):
      for value in node:
        walk(value)

  walk(schema)
  return schema


def _validate_core(doc: dict) -> None:
  kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _pools(jobset: dict) -> list[dict]:
  return jobset["spec"]["replicatedJobs"]


def _container(job_template: dict) -> dict:
  (container,) = job_template["spec"]["template"]["spec"]["containers"]
  return container


def _env(container: dict) -> dict[str, str]:
  return {e["name"]: e.get("value") for e in container["env"]}


def test_jobset_and_its_pools_match_their_schemas():
  docs = _docs(JOBSET)
  assert set(docs) == {"JobSet", "PersistentVolumeClaim"}
  _validate_core(docs["PersistentVolumeClaim"])
  with open(JOBSET_SCHEMA) as f:
    schema = _strict(json.load(f)["schema"])
  jsonschema.Draft7Validator(schema).validate(docs["JobSet"])
  for pool in _pools(docs["JobSet"]):
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": pool["name"]},
           **pool["template"]}
    _validate_core(job)


def test_a_typo_is_caught_by_the_strict_schemas():
  docs = _docs(JOBSET)
  with open(JOBSET_SCHEMA) as f:
    schema = _strict(json.load(f)["schema"])
  broken = copy.deepcopy(docs["JobSet"])
  broken["spec"]["failurePolicy"]["maxRestart"] = 3
  with pytest.raises(jsonschema.ValidationError, match="maxRestart"):
    jsonschema.Draft7Validator(schema).validate(broken)
  broken = copy.deepcopy(docs["JobSet"])
  broken["spec"]["failurePolicy"]["rules"][0]["action"] = "RestartForever"
  with pytest.raises(jsonschema.ValidationError, match="RestartForever"):
    jsonschema.Draft7Validator(schema).validate(broken)
  pool = copy.deepcopy(_pools(docs["JobSet"])[0])
  pool["template"]["spec"]["template"]["spec"]["terminationGracePeriod"] = 300
  with pytest.raises(kubernetes_validate.ValidationError):
    _validate_core({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "x"},
                    **pool["template"]})


def test_indexed_job_manifest_matches_the_kubernetes_schemas():
  docs = _docs(INDEXED_JOB)
  assert set(docs) == {"Job", "Service", "PersistentVolumeClaim"}
  for doc in docs.values():
    _validate_core(doc)


def test_pools_agree_on_the_cluster_and_number_hosts_across_pools():
  jobset = _docs(JOBSET)["JobSet"]
  pools = _pools(jobset)
  assert len(pools) >= 2
  sizes = [p["template"]["spec"]["completions"] for p in pools]
  total = sum(sizes)
  subdomain = jobset["spec"].get("network", {}).get("subdomain", jobset["metadata"]["name"])
  assert jobset["spec"]["network"]["enableDNSHostnames"] is True
  offset = 0
  for pool, size in zip(pools, sizes):
    spec = pool["template"]["spec"]
    assert pool["replicas"] == 1 and spec["completionMode"] == "Indexed"
    assert spec["parallelism"] == size and spec["backoffLimit"] == 0
    container = _container(pool["template"])
    env = _env(container)
    assert env["HETJAX_NUM_HOSTS"] == str(total)
    assert env["HETJAX_HOST_OFFSET"] == str(offset)
    # Host 0 is pod 0 of the first pool: <jobset>-<job>-<job index>-<pod index>.<subdomain>.
    (port,) = container["ports"]
    assert env["HETJAX_COORDINATOR"] == (
        f"{jobset['metadata']['name']}-{pools[0]['name']}-0-0.{subdomain}:{port['containerPort']}")
    offset += size
  # Each pool its own nodes and GPU count: that is what the JobSet is for.
  selectors = [json.dumps(p["template"]["spec"]["template"]["spec"]["nodeSelector"]) for p in pools]
  gpus = [_container(p["template"])["resources"]["limits"]["nvidia.com/gpu"] for p in pools]
  assert len(set(selectors)) == len(pools) and len(set(gpus)) > 1
  for pool in pools:
    assert pool["template"]["spec"]["template"]["spec"]["tolerations"]


@pytest.mark.parametrize("pool_index, completion_index", [(0, 0), (0, 1), (1, 0)])
def test_each_pod_computes_its_host_id_and_the_runtime_reads_it(pool_index, completion_index):
  jobset = _docs(JOBSET)["JobSet"]
  pool = _pools(jobset)[pool_index]
  container = _container(pool["template"])
  shell, dash_c, line, program, *_ = container["command"]
  assert (shell, dash_c, program) == ("/bin/sh", "-c", "hetjax")
  env = {k: v for k, v in os.environ.items() if not k.startswith("HETJAX_")}
  env.update(_env(container), JOB_COMPLETION_INDEX=str(completion_index))
  # The container's own line, with a program that prints what hetjax would get.
  seen = subprocess.run(["/bin/sh", "-c", line, sys.executable, "-c",
                         "import json, os; print(json.dumps(dict(os.environ)))"],
                        env=env, capture_output=True, text=True, timeout=60, check=True)
  pod_env = json.loads(seen.stdout)
  from hetjax.cluster import runtime
  spec = runtime.resolve(pod_env)
  offset = int(_env(container)["HETJAX_HOST_OFFSET"])
  assert (spec.coordinator, spec.num_hosts, spec.host_id) == (
      "hetjax-a100-0-0.hetjax:29517", 3, offset + completion_index)
  assert spec.detect is None and spec.local_device_ids is None  # Every GPU of the pod.


# The chosen policy, pinned: what each exit of a host does (docs/cluster.md).
POD_RULES = [
    {"action": "FailJob", "onExitCodes": {"containerName": "host", "operator": "In",
                                          "values": [exits.WRITE_FAILED_EXIT]}},
    {"action": "Ignore", "onExitCodes": {"containerName": "host", "operator": "In",
                                         "values": [exits.PREEMPTED_EXIT]}},
    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
]


def _outcome(pod_rules: list[dict], jobset_rules: list[dict], exit_code: int) -> str:
  """What Kubernetes and JobSet do when one host's container exits `exit_code`.

  A pod rule matches first (in order); Ignore replaces the pod; FailJob fails
  the Job with reason PodFailurePolicy; no match spends backoffLimit (0), so
  the Job fails with BackoffLimitExceeded. The JobSet then applies its first
  rule for that reason, or its default: a restart counted against maxRestarts.
  """
  action = next((r["action"] for r in pod_rules
                 if exit_code in r.get("onExitCodes", {}).get("values", [])), None)
  if action == "Ignore":
    return "pod replaced in place"
  reason = "PodFailurePolicy" if action == "FailJob" else "BackoffLimitExceeded"
  rule = next((r for r in jobset_rules if reason in r["onJobFailureReasons"]), None)
  if rule is None:
    return "counted restart"  # JobSet's default: RestartJobSet, up to maxRestarts.
  return {"FailJobSet": "job set fails"}.get(rule["action"], rule["action"])


@pytest.mark.parametrize("exit_code, outcome", [
    (exits.PREEMPTED_EXIT, "pod replaced in place"),
    (exits.WRITE_FAILED_EXIT, "job set fails"),
    (exits.STALLED_EXIT, "counted restart"),
    (exits.FAILED_EXIT, "counted restart"),
    (137, "counted restart"),
])
def test_each_exit_of_a_host_ends_as_the_docs_say(exit_code, outcome):
  jobset = _docs(JOBSET)["JobSet"]
  policy = jobset["spec"]["failurePolicy"]
  assert policy["maxRestarts"] >= 1
  assert policy["rules"] == [{"name": "checkpointWriteFailed", "action": "FailJobSet",
                              "onJobFailureReasons": ["PodFailurePolicy"]}]
  for pool in _pools(jobset):
    spec = pool["template"]["spec"]
    assert spec["podFailurePolicy"]["rules"] == POD_RULES
    assert spec["backoffLimit"] == 0 and spec["template"]["spec"]["restartPolicy"] == "Never"
    assert _outcome(spec["podFailurePolicy"]["rules"], policy["rules"], exit_code) == outcome


def test_the_indexed_job_replaces_a_preempted_pod_and_stops_on_anything_else():
  job = _docs(INDEXED_JOB)["Job"]
  assert job["spec"]["podFailurePolicy"]["rules"] == POD_RULES
  assert job["spec"]["backoffLimit"] == 0
  assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"


@pytest.mark.parametrize("path", [JOBSET, INDEXED_JOB])
def test_pods_have_shared_checkpoints_shm_and_time_to_save(path):
  docs = _docs(path)
  claim = docs["PersistentVolumeClaim"]
  assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
  templates = ([p["template"] for p in _pools(docs["JobSet"])] if "JobSet" in docs
               else [docs["Job"]])
  for template in templates:
    pod = template["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 120
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in _container(template)["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    runs = volumes[mounts["/runs"]]["persistentVolumeClaim"]["claimName"]
    assert runs == claim["metadata"]["name"]
    command = _container(template)["command"]
    ckpt = command[command.index("--ckpt-dir") + 1]
    assert ckpt.startswith("/runs/")  # On the shared volume, not in the pod.
