//! The import direction of the crate: every module of `src/` may use only
//! modules of a lower layer (or its own module). A `crate::` path that
//! points up or sideways fails this test with the file, the line and the
//! two layers. Inside a folder, the files (and subfolders) may not import
//! each other in a cycle either. Read with `docs/architecture.md`, which
//! draws the same table.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// `(module path, layer)`: a file belongs to the longest entry that
/// prefixes its module path, and so does every `crate::` path it uses. A
/// module may use its own entry's modules and those of lower layers only;
/// two entries on the same layer may not use each other.
const LAYERS: &[(&str, u32)] = &[
    // Leaves: know nothing of the rest of the crate.
    ("clock", 0),
    ("config", 0),
    ("contract", 0),
    ("hugepages", 0),
    ("sigma_rel", 0),
    // The run configuration (with its alert rules) and the wire format.
    ("run", 1),
    ("wire", 2),
    // This server's node id and advertised URL.
    ("node", 2),
    // The engine thread, then what is built beside it: the on-disk snapshot
    // format and the download/compare/post-hoc machinery over it, the
    // catalog, the object store, the Prometheus registry.
    ("engine", 3),
    ("snapshot", 4),
    ("store", 4),
    ("objstore", 3),
    ("telemetry", 4),
    // The run registry and the event bus.
    ("registry", 5),
    ("events", 5),
    // Services, in their own order: the shared context and the error first,
    // monitoring and alerts, the snapshot lifecycle, then the jobs built on
    // it and ingest.
    ("services", 6),
    ("services::error", 6),
    ("services::monitor", 7),
    ("services::peer", 7),
    ("services::alerts", 7),
    ("services::pipeline", 7),
    ("services::snapshots", 8),
    // Built on the snapshot lifecycle: ingest, deleting runs, and the
    // service's nodes keeping up with each other (failover restores ranks
    // from snapshots); the lease, which lets taken ranks go, last.
    ("services::ingest", 9),
    ("services::cluster", 9),
    // Readiness and the scrape's gauges read the snapshot service's disk
    // figures; verifying rereads its parts.
    ("services::ops", 9),
    // Creating a run places it and tells the peers (cluster).
    ("services::runs", 10),
    ("services::nodes", 10),
    // Handles to the services, then the HTTP edge, then the wiring.
    ("state", 11),
    ("http", 12),
    ("server", 13),
];

/// The module path of a source file: `src/services/ingest.rs` ->
/// `services::ingest`, `src/snapshot/mod.rs` -> `snapshot`.
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src");
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().trim_end_matches(".rs").to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    parts.join("::")
}

/// The table entry a module path belongs to.
fn unit_of(path: &str) -> Option<(&'static str, u32)> {
    LAYERS
        .iter()
        .filter(|(name, _)| path == *name || path.starts_with(&format!("{name}::")))
        .max_by_key(|(name, _)| name.len())
        .copied()
}

/// Every `crate::` path a file uses, with its line number: `use` lines
/// (grouped ones too: `use crate::{a::B, c}`) and paths written inline.
/// `super::` paths are resolved against `module` (the file's module path)
/// first, so a sibling reached through `super` is checked as well; after a
/// line opening an inline `mod name {` (the tests at the end of a file),
/// `super` is the file's own module. Comments are skipped.
fn crate_paths(module: &str, text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut inner = None;
    for (n, line) in text.lines().enumerate() {
        let code = match line.find("//") {
            Some(i) => &line[..i],
            None => line,
        };
        let words: Vec<&str> = code.split_whitespace().collect();
        if matches!(words.as_slice(), ["mod", _, "{"] | ["pub", "mod", _, "{"]) {
            inner = Some(format!("{module}::{}", words[words.len() - 2]));
        }
        let code = resolve_super(inner.as_deref().unwrap_or(module), code);
        let mut rest = code.as_str();
        while let Some(i) = rest.find("crate::") {
            let before = rest[..i].chars().last();
            let after = &rest[i + "crate::".len()..];
            rest = after;
            if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
                continue; // `mycrate::`, not ours
            }
            if let Some(group) = after.strip_prefix('{') {
                let end = group.find('}').unwrap_or(group.len());
                for item in group[..end].split(',') {
                    let head = path_head(item.trim());
                    if !head.is_empty() {
                        out.push((n + 1, head));
                    }
                }
            } else {
                let head = path_head(after);
                if !head.is_empty() {
                    out.push((n + 1, head)); // `crate::*` alone names no module
                }
            }
        }
    }
    out
}

/// The line with each `super::` chain written as the `crate::` path it
/// names: in `services::ingest`, `super::monitor` is `crate::services::monitor`.
fn resolve_super(module: &str, code: &str) -> String {
    let mut out = String::new();
    let mut rest = code;
    while let Some(i) = rest.find("super::") {
        let before = rest[..i].chars().last();
        out.push_str(&rest[..i]);
        rest = &rest[i..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            out.push_str("super::");
            rest = &rest["super::".len()..];
            continue;
        }
        let mut parts: Vec<&str> = module.split("::").filter(|p| !p.is_empty()).collect();
        while let Some(after) = rest.strip_prefix("super::") {
            parts.pop();
            rest = after;
        }
        out.push_str("crate::");
        for p in parts {
            out.push_str(p);
            out.push_str("::");
        }
    }
    out.push_str(rest);
    out
}

/// `services::ingest::Ingest;` -> `services::ingest::Ingest`
fn path_head(s: &str) -> String {
    s.chars()
        .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
        .collect::<String>()
        .trim_end_matches(':')
        .to_string()
}

/// A source file as messages name it: `src/snapshot/format.rs`.
fn shown(src: &Path, file: &Path) -> String {
    file.strip_prefix(src.parent().unwrap_or(src))
        .unwrap_or(file)
        .display()
        .to_string()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The upward (or sideways) imports under `src`, one line each.
fn violations(src: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mut found = Vec::new();
    for file in files {
        let module = module_of(src, &file);
        let shown = shown(src, &file);
        if module == "lib" || module == "main" {
            continue; // they declare and start everything
        }
        let Some((unit, layer)) = unit_of(&module) else {
            found.push(format!(
                "{shown}: module `{module}` is in no layer; add it to LAYERS"
            ));
            continue;
        };
        let text = std::fs::read_to_string(&file).expect("read a source file");
        for (line, path) in crate_paths(&module, &text) {
            let Some((target, target_layer)) = unit_of(&path) else {
                found.push(format!("{shown}:{line}: `crate::{path}` is in no layer"));
                continue;
            };
            if target == unit || target_layer < layer {
                continue;
            }
            found.push(format!(
                "{shown}:{line}: `{unit}` (layer {layer}) uses `crate::{path}` (`{target}`, layer {target_layer})"
            ));
        }
    }
    found
}

#[test]
fn modules_only_use_lower_layers() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = violations(&src);
    assert!(
        found.is_empty(),
        "imports against the layer order (see LAYERS in tests/layers.rs):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_table_puts_every_module_somewhere_and_keeps_its_order() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut per_layer: BTreeMap<u32, Vec<&str>> = BTreeMap::new();
    for (name, layer) in LAYERS {
        per_layer.entry(*layer).or_default().push(name);
    }
    // Leaves exist and the wiring is on top.
    assert_eq!(
        per_layer[&0],
        ["clock", "config", "contract", "hugepages", "sigma_rel"]
    );
    assert_eq!(
        unit_of("server").map(|u| u.1),
        per_layer.keys().last().copied()
    );
    assert_eq!(
        unit_of("services::ingest::Ingest"),
        Some(("services::ingest", 9))
    );
    assert_eq!(unit_of("services::Context"), Some(("services", 6)));
    assert_eq!(
        unit_of("snapshot::format::SnapshotMeta"),
        Some(("snapshot", 4))
    );
    assert_eq!(unit_of("registryx"), None);
}

#[test]
fn the_scanner_sees_grouped_inline_and_commented_paths() {
    let text = "use crate::{wire::DType, engine};\n\
                let x = crate::clock::now_ms(); // crate::http::router\n\
                // use crate::server;\n\
                use mycrate::thing;\n";
    let paths = crate_paths("services::ingest", text);
    assert_eq!(
        paths,
        vec![
            (1, "wire::DType".to_string()),
            (1, "engine".to_string()),
            (2, "clock::now_ms".to_string()),
        ]
    );
    let text = "use super::monitor::note;\nuse super::super::http::router;\n\
                mod tests {\n    use super::*;\n    use super::super::error::E;\n}\n";
    assert_eq!(
        crate_paths("services::ingest", text),
        vec![
            (1, "services::monitor::note".to_string()),
            (2, "http::router".to_string()),
            (4, "services::ingest".to_string()),
            (5, "services::error::E".to_string()),
        ]
    );
}

#[test]
fn an_upward_import_is_reported() {
    let dir = std::env::temp_dir().join(format!("polyak-layers-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("engine")).expect("temp src");
    std::fs::write(
        dir.join("engine/mod.rs"),
        "use crate::wire::DType;\nuse crate::http::ApiError;\n",
    )
    .expect("write");
    std::fs::write(dir.join("wire.rs"), "use super::engine::Engine;\n").expect("write");
    let found = violations(&dir);
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].contains("`engine` (layer 3) uses `crate::http::ApiError`"));
    assert!(found[1].contains("`wire` (layer 2) uses `crate::engine::Engine`"));
}

/// The `crate::` paths of a file's own code: [`crate_paths`] up to the
/// first inline `mod name {` (the tests at the end of a file, which may
/// build their fixtures with any sibling).
fn code_paths(module: &str, text: &str) -> Vec<(usize, String)> {
    let end = text
        .lines()
        .position(|line| {
            let code = line.split("//").next().unwrap_or("");
            let words: Vec<&str> = code.split_whitespace().collect();
            matches!(words.as_slice(), ["mod", _, "{"] | ["pub", "mod", _, "{"])
        })
        .unwrap_or(usize::MAX);
    crate_paths(module, text)
        .into_iter()
        .filter(|(line, _)| *line <= end)
        .collect()
}

/// Per folder (its module path), per entry (a file or a subfolder taken
/// whole), the entries of the same folder it imports, each with the first
/// `file:line` that does.
type Graph = BTreeMap<String, BTreeMap<String, BTreeMap<String, String>>>;

/// The imports between the entries of every folder under `src`. A
/// folder's `mod.rs` is left out, as `lib.rs` is at the top: it declares
/// its children and re-exports what they make, so every child reaching
/// the folder's front door is no cycle. The top level is the layer
/// table's business.
fn folder_graph(src: &Path) -> Graph {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    let mut graph = Graph::new();
    for file in files {
        let module = module_of(src, &file);
        let parts: Vec<&str> = module.split("::").collect();
        let shown = shown(src, &file);
        let text = std::fs::read_to_string(&file).expect("read a source file");
        let paths = code_paths(&module, &text);
        // Every folder the file is in, below the top: `snapshot` for
        // `snapshot::format`, and `services`, `services::snapshots` for
        // `services::snapshots::cuts`.
        for depth in 1..parts.len() {
            let folder = parts[..depth].join("::");
            let from = parts[depth];
            let dir = src.join(parts[..depth].join("/"));
            for (line, path) in &paths {
                let Some(rest) = path.strip_prefix(&format!("{folder}::")) else {
                    continue;
                };
                let to = rest.split("::").next().unwrap_or("");
                let is_entry = dir.join(format!("{to}.rs")).is_file() || dir.join(to).is_dir();
                if to == from || !is_entry {
                    continue;
                }
                graph
                    .entry(folder.clone())
                    .or_default()
                    .entry(from.to_string())
                    .or_default()
                    .entry(to.to_string())
                    .or_insert_with(|| format!("{shown}:{line}"));
            }
        }
    }
    graph
}

/// One line per import cycle inside a folder: the entries around it and
/// where each import is written. Each cycle is reported once, from its
/// smallest entry.
fn folder_cycles(graph: &Graph) -> Vec<String> {
    let mut found = Vec::new();
    for (folder, edges) in graph {
        let mut reported: BTreeSet<BTreeSet<&str>> = BTreeSet::new();
        for start in edges.keys() {
            // Shortest way back to `start`, breadth first.
            let mut back: BTreeMap<&str, &str> = BTreeMap::new();
            let mut queue = std::collections::VecDeque::from([start.as_str()]);
            let mut closed = None;
            while let Some(at) = queue.pop_front() {
                for next in edges.get(at).into_iter().flat_map(|e| e.keys()) {
                    if next == start {
                        closed = Some(at);
                        break;
                    }
                    if !back.contains_key(next.as_str()) {
                        back.insert(next, at);
                        queue.push_back(next);
                    }
                }
                if closed.is_some() {
                    break;
                }
            }
            let Some(mut at) = closed else { continue };
            let mut ring = vec![start.as_str()];
            while at != start {
                ring.push(at);
                at = back[at];
            }
            ring[1..].reverse();
            if !reported.insert(ring.iter().copied().collect()) {
                continue;
            }
            let steps: Vec<String> = ring
                .iter()
                .zip(ring.iter().cycle().skip(1))
                .map(|(a, b)| format!("{a} -> {b} ({})", edges[*a][*b]))
                .collect();
            found.push(format!("`{folder}`: {}", steps.join(", ")));
        }
    }
    found
}

#[test]
fn no_folder_has_an_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let found = folder_cycles(&folder_graph(&src));
    assert!(
        found.is_empty(),
        "files of one folder importing each other in a cycle:\n{}",
        found.join("\n")
    );
}

/// A hand-made folder graph: `format -> compare -> assemble -> format` is
/// reported once, with where each import is; the same graph without
/// `assemble -> format` passes, and so does a folder whose entries only
/// reach its `mod.rs`.
#[test]
fn a_cycle_inside_a_folder_is_reported() {
    let edge = |from: &str, to: &str| (from.to_string(), to.to_string());
    let graph_of = |edges: &[(String, String)]| {
        let mut graph = Graph::new();
        for (from, to) in edges {
            graph
                .entry("snapshot".to_string())
                .or_default()
                .entry(from.clone())
                .or_default()
                .insert(to.clone(), format!("src/snapshot/{from}.rs:1"));
        }
        graph
    };
    let cyclic = [
        edge("format", "compare"),
        edge("compare", "assemble"),
        edge("assemble", "format"),
        edge("assemble", "vfile"),
        edge("vfile", "source"),
    ];
    let found = folder_cycles(&graph_of(&cyclic));
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(
        found[0],
        "`snapshot`: assemble -> format (src/snapshot/assemble.rs:1), \
         format -> compare (src/snapshot/format.rs:1), \
         compare -> assemble (src/snapshot/compare.rs:1)"
    );
    let acyclic = &cyclic[..2];
    assert_eq!(folder_cycles(&graph_of(acyclic)), Vec::<String>::new());
    // Two files that import each other are a cycle too.
    let pair = [edge("format", "meta"), edge("meta", "format")];
    assert_eq!(folder_cycles(&graph_of(&pair)).len(), 1);

    // From files: `super::` and `crate::` imports between siblings count,
    // the folder's `mod.rs` and inline test modules do not.
    let dir = std::env::temp_dir().join(format!("polyak-cycles-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("snapshot")).expect("temp src");
    let write = |name: &str, text: &str| {
        std::fs::write(dir.join("snapshot").join(name), text).expect("write");
    };
    write("mod.rs", "pub mod a;\npub mod b;\npub use a::A;\n");
    write("a.rs", "use super::b::B;\npub struct A;\n");
    write(
        "b.rs",
        "use crate::snapshot::A;\npub struct B;\nmod tests {\n    use super::super::a::A;\n}\n",
    );
    let graph = folder_graph(&dir);
    assert_eq!(folder_cycles(&graph), Vec::<String>::new(), "{graph:?}");
    write("b.rs", "use crate::snapshot::a::A;\npub struct B;\n");
    let found = folder_cycles(&folder_graph(&dir));
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("`snapshot`: a -> b (") && found[0].contains("snapshot/b.rs:1)"),
        "{found:?}"
    );
}

/// What the HTTP handlers may not reach into: they call services, and the
/// services own the registry, the engines, the catalog and the snapshots.
const BELOW_HANDLERS: &[&str] = &["store", "engine", "snapshot", "registry"];

/// The handler modules that still reach below the services today, and
/// what they reach: a list that may only shrink (an entry no longer
/// needed fails [`handlers_reach_below_services_only_where_listed`]).
const HANDLERS_REACHING_BELOW: &[(&str, &str)] = &[
    ("http", "engine"),
    ("http", "snapshot"),
    ("http", "store"),
    ("http::auth", "registry"),
    ("http::derived", "store"),
    ("http::error", "engine"),
    ("http::error", "snapshot"),
    ("http::error", "store"),
    ("http::events", "store"),
    ("http::extract", "registry"),
    ("http::insight", "store"),
    ("http::push", "store"),
    ("http::route", "registry"),
    ("http::runs", "engine"),
    ("http::runs", "registry"),
    ("http::runs", "snapshot"),
    ("http::runs", "store"),
    ("http::snapshots", "snapshot"),
    ("http::snapshots", "store"),
    ("http::vanished", "registry"),
];

/// Per handler module, the units below the services it imports.
fn handler_reach(src: &Path) -> BTreeMap<(String, String), String> {
    let mut files = Vec::new();
    rust_files(&src.join("http"), &mut files);
    files.sort();
    let mut out = BTreeMap::new();
    for file in files {
        let module = module_of(src, &file);
        let shown = shown(src, &file);
        let text = std::fs::read_to_string(&file).expect("read a source file");
        for (line, path) in code_paths(&module, &text) {
            let Some((unit, _)) = unit_of(&path) else {
                continue;
            };
            let top = unit.split("::").next().unwrap_or(unit);
            if BELOW_HANDLERS.contains(&top) {
                out.entry((module.clone(), top.to_string()))
                    .or_insert_with(|| format!("{shown}:{line}"));
            }
        }
    }
    out
}

#[test]
fn handlers_reach_below_services_only_where_listed() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let reach = handler_reach(&src);
    let listed: BTreeSet<(String, String)> = HANDLERS_REACHING_BELOW
        .iter()
        .map(|(m, u)| (m.to_string(), u.to_string()))
        .collect();
    let new: Vec<String> = reach
        .iter()
        .filter(|(k, _)| !listed.contains(*k))
        .map(|((m, u), at)| format!("`{m}` uses `crate::{u}` ({at}): call a service instead"))
        .collect();
    assert!(new.is_empty(), "{}", new.join("\n"));
    let stale: Vec<String> = listed
        .iter()
        .filter(|k| !reach.contains_key(*k))
        .map(|(m, u)| format!("(\"{m}\", \"{u}\")"))
        .collect();
    assert!(
        stale.is_empty(),
        "no longer used; remove from HANDLERS_REACHING_BELOW: {}",
        stale.join(", ")
    );
}
