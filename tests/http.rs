//! Integration tests against the real binary on port 0.

mod common;

use common::{f32_body, read_f32, TestServer};
use serde_json::{json, Value};

#[test]
fn push_then_read_back_the_ema() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &[]);
    let r = server.post_json(
        "/v1/runs",
        json!({"name": "it", "world_size": 1,
               "profiles": [{"name": "ema", "kind": "constant", "beta": 0.75}]}),
    );
    assert_eq!(r.status(), 201);
    let steps = [
        vec![1.0f32, 2.0, 3.0],
        vec![5.0, 6.0, 7.0],
        vec![9.0, 10.0, 11.0],
    ];
    for (step, w) in steps.iter().enumerate() {
        let r = server.put(
            &format!("/v1/runs/it/ranks/0/steps/{step}"),
            f32_body(&[("w", vec![3], w.clone())], &[]),
        );
        assert_eq!(r.status(), 200);
        let v: Value = r.json().unwrap();
        assert_eq!(v["applied"], true);
        assert_eq!(v["last_step"], step as u64);
    }
    // ema = 1,2,3 -> lerp(0.25) to 5,6,7 -> 2,3,4 -> lerp(0.25) to 9,10,11 -> 3.75,4.75,5.75
    let file = server
        .get("/v1/runs/it/ranks/0/ema?profile=ema")
        .bytes()
        .unwrap();
    assert_eq!(read_f32(&file, "w"), vec![3.75, 4.75, 5.75]);
    let rank: Value = server
        .get("/v1/runs/it/ranks/0?layout=true")
        .json()
        .unwrap();
    assert_eq!(rank["last_step"], 2);
    assert_eq!(rank["pushes"], 3);
    assert_eq!(rank["status"], "live");
    assert_eq!(rank["layout"]["tensors"][0]["name"], "w");
    // Unknown profile and unknown run answer in the error shape.
    let r = server.get("/v1/runs/it/ranks/0/ema?profile=nope");
    assert_eq!(r.status(), 404);
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["code"], "profile_not_found");
    let r = server.get("/v1/runs/missing");
    assert_eq!(r.status(), 404);
}

#[test]
fn run_config_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = TestServer::start(dir.path(), &[]);
    let spec = json!({
        "name": "durable", "world_size": 3, "update_every": 4, "mirror": true,
        "copy_patterns": ["*.running_*"], "nonfinite": "skip_tensor",
        "profiles": [
            {"name": "fast", "kind": "constant", "beta": 0.9},
            {"name": "edm", "kind": "power", "sigma_rel": 0.05},
            {"name": "warm", "kind": "warmup", "update_after_step": 7, "min_value": 0.1}
        ]
    });
    assert_eq!(server.post_json("/v1/runs", spec).status(), 201);
    let r = server.put(
        "/v1/runs/durable/ranks/1/steps/0",
        f32_body(&[("w", vec![2], vec![1.0, 2.0])], &[]),
    );
    assert_eq!(r.status(), 200);
    let before: Value = server.get("/v1/runs/durable").json().unwrap();
    // Let the batched catalog writer flush before stopping.
    std::thread::sleep(std::time::Duration::from_millis(500));
    server.restart();
    let listed: Value = server.get("/v1/runs").json().unwrap();
    let runs = listed["runs"].as_array().unwrap();
    assert_eq!(runs.len(), 1);
    assert_eq!(runs[0]["name"], "durable");
    let after: Value = server.get("/v1/runs/durable").json().unwrap();
    assert_eq!(after["config"], before["config"]);
    assert_eq!(
        after["config"]["profiles"][1]["gamma"],
        before["config"]["profiles"][1]["gamma"]
    );
    assert_eq!(after["created_at"], before["created_at"]);
    // The rank's bookkeeping is in the catalog too.
    assert_eq!(after["ranks"][1]["last_step"], 0);
    assert_eq!(after["ranks"][1]["tensors"], 1);
}

#[test]
fn ops_endpoints() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &[]);
    let live: Value = server.get("/livez").json().unwrap();
    assert_eq!(live["status"], "ok");
    let r = server.get("/readyz");
    assert_eq!(r.status(), 200);
    let spec: Value = server.get("/openapi.json").json().unwrap();
    assert!(spec["openapi"].as_str().unwrap().starts_with("3."));
    for path in [
        "/v1/runs",
        "/v1/runs/{run}",
        "/v1/runs/{run}/ranks/{rank}/steps/{step}",
        "/v1/runs/{run}/ranks/{rank}/ema",
    ] {
        assert!(
            spec["paths"][path].is_object(),
            "{path} missing from the OpenAPI document"
        );
    }
    let docs = server.get("/docs");
    assert_eq!(docs.status(), 200);
    let html = docs.text().unwrap();
    assert!(html.contains("openapi.json"), "docs page renders the spec");
    assert!(
        !html.contains("https://"),
        "docs page loads nothing from the network"
    );
    // Metrics carry the polyak_ prefix and count pushes.
    server.post_json("/v1/runs", json!({"name": "m", "world_size": 1}));
    server.put(
        "/v1/runs/m/ranks/0/steps/0",
        f32_body(&[("w", vec![1], vec![1.0])], &[]),
    );
    server.put("/v1/runs/m/ranks/0/steps/0", b"junk".to_vec());
    let text = server.get("/metrics").text().unwrap();
    assert!(
        text.contains("polyak_pushes_total{outcome=\"applied\",run=\"m\"} 1"),
        "{text}"
    );
    assert!(text.contains("polyak_rejections_total{code=\"invalid_safetensors\",run=\"m\"} 1"));
    assert!(text.contains("polyak_push_seconds_bucket"));
}

#[test]
fn non_loopback_bind_needs_a_token() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_polyak"))
        .args(["serve", "--bind", "0.0.0.0:0", "--data-dir"])
        .arg(tempfile::tempdir().unwrap().path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--token"), "{err}");
}

#[test]
fn cuda_without_a_gpu_fails_at_start_with_a_clear_message() {
    if polyak::engine::device::cuda_device_count() > 0 {
        return; // this machine has CUDA; the GPU check script covers it
    }
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_polyak"))
        .args([
            "serve",
            "--bind",
            "127.0.0.1:0",
            "--device",
            "cuda",
            "--data-dir",
        ])
        .arg(tempfile::tempdir().unwrap().path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no CUDA device"), "{err}");
}

#[test]
fn tokens_guard_runs() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &["--token", "admin-secret-0123456789"]);
    let c = server.client();
    let r = c
        .post(format!("{}/v1/runs", server.url))
        .json(&json!({"name": "sec", "world_size": 1}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = c
        .post(format!("{}/v1/runs", server.url))
        .bearer_auth("admin-secret-0123456789")
        .json(&json!({"name": "sec", "world_size": 1}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 201);
    let created: Value = r.json().unwrap();
    let write = created["write_token"].as_str().unwrap().to_string();
    let read = created["read_token"].as_str().unwrap().to_string();
    let body = f32_body(&[("w", vec![1], vec![1.0])], &[]);
    let url = format!("{}/v1/runs/sec/ranks/0/steps/0", server.url);
    assert_eq!(c.put(&url).body(body.clone()).send().unwrap().status(), 401);
    assert_eq!(
        c.put(&url)
            .bearer_auth(&read)
            .body(body.clone())
            .send()
            .unwrap()
            .status(),
        403
    );
    assert_eq!(
        c.put(&url)
            .bearer_auth(&write)
            .body(body)
            .send()
            .unwrap()
            .status(),
        200
    );
    let ema = format!("{}/v1/runs/sec/ranks/0/ema", server.url);
    assert_eq!(c.get(&ema).bearer_auth(&read).send().unwrap().status(), 200);
    assert_eq!(c.get(&ema).send().unwrap().status(), 401);
    assert_eq!(
        c.get(format!("{ema}?access_token={read}"))
            .send()
            .unwrap()
            .status(),
        200
    );
    // A token nobody holds is unauthenticated (401), not forbidden.
    assert_eq!(
        c.get(&ema).bearer_auth("wrong").send().unwrap().status(),
        401
    );
    // Deleting needs the admin.
    let run = format!("{}/v1/runs/sec", server.url);
    assert_eq!(
        c.delete(&run).bearer_auth(&write).send().unwrap().status(),
        403
    );
    assert_eq!(
        c.delete(&run)
            .bearer_auth("admin-secret-0123456789")
            .send()
            .unwrap()
            .status(),
        204
    );
}

/// The string enums of `clients/python/polyak/contract.py`: class name ->
/// member values, in order (`class X(str, Enum):` then `NAME = "value"`).
fn python_contract_enums() -> std::collections::BTreeMap<String, Vec<String>> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/clients/python/polyak/contract.py"
    );
    let text = std::fs::read_to_string(path).unwrap();
    let mut out = std::collections::BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("class ") {
            current = rest
                .strip_suffix("(str, Enum):")
                .map(|name| name.to_string());
            continue;
        }
        if !line.starts_with("    ") && !line.trim().is_empty() {
            current = None;
        }
        let Some(class) = &current else { continue };
        let Some((name, value)) = line.trim().split_once(" = ") else {
            continue;
        };
        if name.chars().all(|c| c.is_ascii_uppercase() || c == '_') {
            let value = value.trim_matches('"').to_string();
            out.entry(class.clone())
                .or_insert_with(Vec::new)
                .push(value);
        }
    }
    out
}

#[test]
fn openapi_enums_are_the_python_clients_and_the_docs() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &[]);
    let spec: Value = server.get("/openapi.json").json().unwrap();
    let schemas = &spec["components"]["schemas"];
    let python = python_contract_enums();
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/contract.md")).unwrap();
    let sets = [
        "SnapshotKind",
        "SnapshotStatus",
        "SnapshotEventStatus",
        "CutKind",
        "EventKind",
        "CandidateKind",
        "BestMode",
        "RunHealth",
        "RankStatus",
        "NodeStatus",
        "AlertKind",
        "AlertState",
        "DownloadLayout",
    ];
    for set in sets {
        let served: Vec<String> = schemas[set]["enum"]
            .as_array()
            .unwrap_or_else(|| panic!("{set} is not a string enum in /openapi.json"))
            .iter()
            .map(|v| v.as_str().unwrap().to_string())
            .collect();
        assert!(!served.is_empty(), "{set}");
        assert_eq!(
            python.get(set),
            Some(&served),
            "polyak.contract.{set} differs from the server's"
        );
        for value in &served {
            assert!(
                docs.contains(&format!("`{value}`")),
                "docs/contract.md does not name {set} `{value}`"
            );
        }
    }
    // Rows and events point at the enums.
    assert_eq!(
        schemas["SnapshotRow"]["properties"]["kind"]["$ref"],
        "#/components/schemas/SnapshotKind"
    );
    assert_eq!(
        schemas["SnapshotRow"]["properties"]["status"]["$ref"],
        "#/components/schemas/SnapshotStatus"
    );
    assert_eq!(
        schemas["StoredEvent"]["properties"]["kind"]["$ref"],
        "#/components/schemas/EventKind"
    );
    for (schema, property, set) in [
        ("RunView", "health", "RunHealth"),
        ("RankView", "status", "RankStatus"),
        ("NodeView", "status", "NodeStatus"),
        ("Alert", "kind", "AlertKind"),
        ("Alert", "state", "AlertState"),
    ] {
        assert_eq!(
            schemas[schema]["properties"][property]["$ref"],
            format!("#/components/schemas/{set}"),
            "{schema}.{property}"
        );
    }
    let download = spec["paths"]["/v1/runs/{run}/snapshots/{id}/download"]["get"]["parameters"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == "layout")
        .cloned()
        .unwrap();
    assert!(
        download["schema"]
            .to_string()
            .contains("#/components/schemas/DownloadLayout"),
        "{download}"
    );
    assert_eq!(download["in"], "query", "{download}");
}

/// The contract's table of run fields (the rows after `**Run fields.**`)
/// names exactly the fields of `POST /v1/runs` the server serves.
#[test]
fn contract_run_fields_table_is_the_run_spec() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &[]);
    let spec: Value = server.get("/openapi.json").json().unwrap();
    let mut served: Vec<String> = spec["components"]["schemas"]["RunSpec"]["properties"]
        .as_object()
        .expect("RunSpec has properties")
        .keys()
        .cloned()
        .collect();
    served.sort();
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/contract.md")).unwrap();
    let (_, after) = docs
        .split_once("**Run fields.**")
        .expect("docs/contract.md has its run fields table");
    let mut documented: Vec<String> = after
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|row| {
            let first = row.trim_start_matches('|').split('|').next()?.trim();
            Some(first.strip_prefix('`')?.strip_suffix('`')?.to_string())
        })
        .collect();
    documented.sort();
    assert!(served.contains(&"persist_every_secs".to_string()));
    assert_eq!(
        documented, served,
        "docs/contract.md's run fields (left) differ from the server's RunSpec (right)"
    );
}

#[test]
fn openapi_document_says_what_the_server_does() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &[]);
    let spec: Value = server.get("/openapi.json").json().unwrap();
    // A bearer scheme, optional as a whole (auth may be off), none on health.
    assert_eq!(
        spec["components"]["securitySchemes"]["bearer"]["scheme"],
        "bearer"
    );
    assert_eq!(spec["security"], json!([{"bearer": []}, {}]));
    assert_eq!(spec["paths"]["/livez"]["get"]["security"], json!([{}]));
    // Every /v1 operation lists the statuses every handler can answer.
    let mut operations = 0;
    for (path, item) in spec["paths"].as_object().unwrap() {
        if !path.starts_with("/v1/") {
            continue;
        }
        for (method, op) in item.as_object().unwrap() {
            operations += 1;
            for status in ["400", "401", "403", "404"] {
                assert!(
                    op["responses"][status].is_object(),
                    "{method} {path} does not list {status}"
                );
            }
            if op["requestBody"].is_object() {
                assert!(op["responses"]["408"].is_object(), "{method} {path}: 408");
            }
            // A path parameter is one the path names; a query parameter a
            // request may leave out (its schema admits null) is optional.
            for p in op["parameters"].as_array().into_iter().flatten() {
                let name = p["name"].as_str().unwrap();
                match p["in"].as_str() {
                    Some("path") => assert!(
                        path.contains(&format!("{{{name}}}")),
                        "{method} {path}: `{name}` is documented as a path parameter"
                    ),
                    Some("query") => {
                        let nullable = p["schema"].to_string().contains(r#""type":"null""#)
                            || p["schema"]["type"]
                                .as_array()
                                .is_some_and(|t| t.contains(&json!("null")));
                        if nullable {
                            assert_eq!(p["required"], json!(false), "{method} {path}: `{name}`");
                        }
                    }
                    Some("header") => {}
                    other => panic!("{method} {path}: `{name}` in {other:?}"),
                }
            }
        }
    }
    assert!(operations >= 20, "{operations}");
    // POST is documented beside PUT on the push route.
    let push = &spec["paths"]["/v1/runs/{run}/ranks/{rank}/steps/{step}"];
    assert!(push["put"].is_object() && push["post"].is_object());
    // The event stream's content type.
    let events = &spec["paths"]["/v1/runs/{run}/events"]["get"]["responses"]["200"]["content"];
    assert!(events["text/event-stream"].is_object(), "{events}");
    assert!(events["application/json"].is_object(), "{events}");
    // JSON object keys are strings: rank_steps says so.
    let rank_steps = &spec["components"]["schemas"]["ResumeResponse"]["properties"]["rank_steps"];
    assert_eq!(rank_steps["propertyNames"], json!({"type": "string"}));
    // since_step stops where the catalog's integers do; past it is a 400.
    let params = spec["paths"]["/v1/runs/{run}/metrics"]["get"]["parameters"]
        .as_array()
        .unwrap();
    let since = params.iter().find(|p| p["name"] == "since_step").unwrap();
    assert_eq!(since["schema"]["maximum"], json!(i64::MAX));
    let r = server.post_json("/v1/runs", json!({"name": "m", "world_size": 1}));
    assert_eq!(r.status(), 201);
    let r = server.get("/v1/runs/m/metrics?since_step=9223372036854775808");
    assert_eq!(r.status(), 400);
    let v: Value = r.json().unwrap();
    assert_eq!(v["error"]["code"], "invalid_query");
    let r = server.get("/v1/runs/m/metrics?since_step=-1");
    assert_eq!(r.status(), 400);
    let r = server.get("/v1/runs/m/metrics?since_step=9223372036854775807");
    assert_eq!(r.status(), 200);
}
