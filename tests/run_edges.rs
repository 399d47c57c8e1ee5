//! The edges of a run: a snapshot of "now" after training, finishing a
//! run, resuming safely, a restart without resume, `exist_ok`, tied names.

mod common;

use common::{f32_body, read_f32, TestServer};
use serde_json::{json, Value};

fn create(server: &TestServer, name: &str, world_size: u32, beta: f64) {
    let r = server.post_json(
        "/v1/runs",
        json!({"name": name, "world_size": world_size,
               "profiles": [{"name": "ema", "kind": "constant", "beta": beta}]}),
    );
    assert_eq!(r.status(), 201);
}

fn push(
    server: &TestServer,
    run: &str,
    rank: u32,
    step: u64,
    w: Vec<f32>,
) -> reqwest::blocking::Response {
    server.put(
        &format!("/v1/runs/{run}/ranks/{rank}/steps/{step}"),
        f32_body(&[("w", vec![w.len()], w)], &[]),
    )
}

/// Polls a snapshot until it is no longer pending (bounded).
fn settled(server: &TestServer, run: &str, id: &str) -> Value {
    for _ in 0..400 {
        let v: Value = server
            .get(&format!("/v1/runs/{run}/snapshots/{id}"))
            .json()
            .unwrap();
        if v["status"] != "pending" {
            return v;
        }
        std::thread::sleep(std::time::Duration::from_millis(25));
    }
    panic!("snapshot {id} still pending");
}

#[test]
fn a_snapshot_without_a_step_cuts_now_when_every_rank_is_there() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &[]);
    create(&server, "now", 2, 0.5);
    for step in 0..3u64 {
        for rank in 0..2 {
            let w = vec![step as f32 + rank as f32; 2];
            assert_eq!(push(&server, "now", rank, step, w).status(), 200);
        }
    }
    // Training is over: every rank applied step 2, so the cut is there, now.
    let r = server.post_json("/v1/runs/now/snapshots", json!({}));
    assert_eq!(r.status(), 202);
    let row: Value = r.json().unwrap();
    assert_eq!(row["step"], 2);
    assert_eq!(row["detail"]["cut"], "current");
    let done = settled(&server, "now", row["id"].as_str().unwrap());
    assert_eq!(done["status"], "complete");

    // Rank 0 one step ahead (mid-step): the next update step, as in v1.
    assert_eq!(push(&server, "now", 0, 3, vec![7.0, 7.0]).status(), 200);
    let row: Value = server
        .post_json("/v1/runs/now/snapshots", json!({}))
        .json()
        .unwrap();
    assert_eq!(row["step"], 4);
    assert_eq!(row["detail"]["cut"], "next_update");
}

#[test]
fn finish_takes_the_final_snapshot_and_refuses_later_pushes() {
    let dir = tempfile::tempdir().unwrap();
    let mut server = TestServer::start(dir.path(), &[]);
    create(&server, "fin", 2, 0.5);
    for step in 0..4u64 {
        assert_eq!(
            push(&server, "fin", 0, step, vec![step as f32]).status(),
            200
        );
        if step < 3 {
            assert_eq!(
                push(&server, "fin", 1, step, vec![step as f32]).status(),
                200
            );
        }
    }
    // Rank 1 is one step behind: the final cut waits for it at step 3.
    let r = server.post_json("/v1/runs/fin/finish", json!({}));
    assert_eq!(r.status(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["run"]["health"], "finished");
    assert_eq!(v["run"]["finished"]["step"], 3);
    assert_eq!(v["snapshot"]["step"], 3);
    assert_eq!(v["snapshot"]["label"], "final");
    assert_eq!(v["snapshot"]["status"], "pending");
    let id = v["snapshot"]["id"].as_str().unwrap().to_string();
    // A push past the final step is refused; the rank behind catches up.
    let r = push(&server, "fin", 0, 4, vec![9.0]);
    assert_eq!(r.status(), 409);
    let e: Value = r.json().unwrap();
    assert_eq!(e["error"]["code"], "run_finished");
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("at step 3"),
        "{e}"
    );
    assert_eq!(push(&server, "fin", 1, 3, vec![3.0]).status(), 200);
    assert_eq!(settled(&server, "fin", &id)["status"], "complete");
    // The EMA of rank 0 after 0,1,2,3 with beta 0.5: 0 -> .5 -> 1.25 -> 2.125.
    let file = server
        .get(&format!(
            "/v1/runs/fin/snapshots/{id}/download?layout=rank&rank=0"
        ))
        .bytes()
        .unwrap();
    let expected = [0.0f32, 1.0, 2.0, 3.0]
        .iter()
        .skip(1)
        .fold(0.0f32, |ema, w| ema * 0.5 + w * 0.5);
    assert_eq!(read_f32(&file, "w"), vec![expected]);
    let ranks: Value = server.get("/v1/runs/fin/ranks").json().unwrap();
    for r in ranks.as_array().unwrap() {
        assert_eq!(r["status"], "finished", "{r}");
    }
    // Finishing again answers how it ended; the mark survives a restart.
    let again: Value = server
        .post_json("/v1/runs/fin/finish", json!({}))
        .json()
        .unwrap();
    assert_eq!(again["snapshot"]["id"], id.as_str());
    std::thread::sleep(std::time::Duration::from_millis(500));
    server.restart();
    let v: Value = server.get("/v1/runs/fin").json().unwrap();
    assert_eq!(v["health"], "finished");
    assert_eq!(v["finished"]["snapshot"], id.as_str());
    assert_eq!(push(&server, "fin", 1, 4, vec![1.0]).status(), 409);
}

#[test]
fn resume_refuses_an_older_snapshot_and_conflicts_name_resume() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &[]);
    create(&server, "res", 1, 0.5);
    for step in 0..=10u64 {
        assert_eq!(
            push(&server, "res", 0, step, vec![step as f32]).status(),
            200
        );
    }
    let row: Value = server
        .post_json("/v1/runs/res/snapshots", json!({}))
        .json()
        .unwrap();
    assert_eq!(row["step"], 10);
    settled(&server, "res", row["id"].as_str().unwrap());
    for step in 11..=15u64 {
        assert_eq!(
            push(&server, "res", 0, step, vec![step as f32]).status(),
            200
        );
    }
    // Only step 10 is stored: resume(15) would lose five updates.
    let r = server.post_json("/v1/runs/res/resume", json!({"step": 15}));
    assert_eq!(r.status(), 409);
    let e: Value = r.json().unwrap();
    assert_eq!(e["error"]["code"], "snapshot_older");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("steps 11..=15") && message.contains("allow_older"),
        "{message}"
    );
    // The EMA was not touched by the refusal.
    let live = read_f32(
        &server.get("/v1/runs/res/ranks/0/ema").bytes().unwrap(),
        "w",
    );
    let full = (1..=15).fold(0.0f32, |ema, w| ema * 0.5 + w as f32 * 0.5);
    assert_eq!(live, vec![full]);
    // resume(10) is exact; allow_older restores 10 and says it is older.
    let v: Value = server
        .post_json(
            "/v1/runs/res/resume",
            json!({"step": 12, "allow_older": true}),
        )
        .json()
        .unwrap();
    assert_eq!(v["step"], 10);
    assert_eq!(v["older"], true);
    assert_eq!(v["requested_step"], 12);
    let v: Value = server
        .post_json("/v1/runs/res/resume", json!({"step": 10}))
        .json()
        .unwrap();
    assert_eq!(v["older"], false);
    // A restart that pushes from 0 again, without resume: the conflict
    // names resume and the step to pass.
    let r = push(&server, "res", 0, 3, vec![3.0]);
    assert_eq!(r.status(), 409);
    let e: Value = r.json().unwrap();
    assert_eq!(e["error"]["code"], "step_conflict");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("run.resume(S)") && message.contains("/v1/runs/res/resume"),
        "{message}"
    );
}

#[test]
fn exist_ok_attaches_to_the_same_configuration_only() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &[]);
    create(&server, "ex", 1, 0.9);
    let same = json!({"name": "ex", "world_size": 1,
                      "profiles": [{"name": "ema", "kind": "constant", "beta": 0.9}]});
    let r = server.post_json("/v1/runs?exist_ok=true", same.clone());
    assert_eq!(r.status(), 200);
    let v: Value = r.json().unwrap();
    assert_eq!(v["name"], "ex");
    // Without exist_ok: 409 as before.
    assert_eq!(server.post_json("/v1/runs", same).status(), 409);
    let r = server.post_json(
        "/v1/runs?exist_ok=true",
        json!({"name": "ex", "world_size": 1, "update_every": 2,
               "profiles": [{"name": "ema", "kind": "constant", "beta": 0.5}]}),
    );
    assert_eq!(r.status(), 409);
    let e: Value = r.json().unwrap();
    assert_eq!(e["error"]["code"], "run_exists");
    let message = e["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("profiles[0].beta: 0.9 != 0.5"),
        "{message}"
    );
    assert!(message.contains("update_every: 1 != 2"), "{message}");
}

#[test]
fn tied_names_are_stored_once_and_downloaded_under_both() {
    let dir = tempfile::tempdir().unwrap();
    let server = TestServer::start(dir.path(), &[]);
    create(&server, "tied", 1, 0.5);
    let aliases = r#"{"head.weight":"embed.weight"}"#;
    for step in 0..2u64 {
        let body = f32_body(
            &[("embed.weight", vec![2], vec![step as f32, 1.0])],
            &[("polyak.aliases", aliases)],
        );
        let r = server.put(&format!("/v1/runs/tied/ranks/0/steps/{step}"), body);
        assert_eq!(r.status(), 200);
    }
    let rank: Value = server
        .get("/v1/runs/tied/ranks/0?layout=true")
        .json()
        .unwrap();
    assert_eq!(rank["tensors"], 1);
    assert_eq!(rank["layout"]["aliases"]["head.weight"], "embed.weight");
    // A push that drops the tie no longer matches the layout.
    let r = server.put(
        "/v1/runs/tied/ranks/0/steps/2",
        f32_body(&[("embed.weight", vec![2], vec![0.0, 0.0])], &[]),
    );
    assert_eq!(r.status(), 409);
    let row: Value = server
        .post_json("/v1/runs/tied/snapshots", json!({}))
        .json()
        .unwrap();
    let id = row["id"].as_str().unwrap();
    settled(&server, "tied", id);
    let full = server
        .get(&format!("/v1/runs/tied/snapshots/{id}/download"))
        .bytes()
        .unwrap();
    let expected = vec![0.5f32, 1.0];
    assert_eq!(read_f32(&full, "embed.weight"), expected);
    assert_eq!(read_f32(&full, "head.weight"), expected);
    // An alias of a name that is not pushed is refused.
    create(&server, "tied-bad", 1, 0.5);
    let r = server.put(
        "/v1/runs/tied-bad/ranks/0/steps/0",
        f32_body(
            &[("embed.weight", vec![2], vec![0.0, 1.0])],
            &[("polyak.aliases", r#"{"head.weight":"missing"}"#)],
        ),
    );
    assert_eq!(r.status(), 422);
}
