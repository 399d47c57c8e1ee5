//! This server as a node of the service: its id and the URL it is reached
//! at, as placement answers name them.

use std::io;
use std::net::SocketAddr;
use std::path::Path;

use crate::config::ServeArgs;

/// The file in the data dir that keeps a generated node id across restarts.
const NODE_ID_FILE: &str = "node-id";

/// Fills in `--node-id` and `--advertise-url` when they were not given: the
/// id kept in the data dir (generated and written the first time), and
/// `http://` with the address bound.
pub fn resolve(args: &mut ServeArgs, bound: SocketAddr) -> io::Result<()> {
    if let Some(id) = &args.node_id {
        if !crate::run::valid_name(id) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "--node-id `{id}`: use up to 128 letters, digits, `.`, `_` or `-`, \
                     starting with a letter or digit"
                ),
            ));
        }
    }
    if args.node_id.is_none() {
        args.node_id = Some(kept_id(&args.data_dir)?);
    }
    if args.advertise_url.is_none() {
        args.advertise_url = Some(format!("http://{bound}"));
    }
    Ok(())
}

/// This node's id and URL, as [`resolve`] filled them in (`polyak serve`
/// always does; `local` and the bind address otherwise).
pub fn identity(args: &ServeArgs) -> (String, String) {
    let id = args.node_id.clone().unwrap_or_else(|| "local".into());
    let url = args
        .advertise_url
        .clone()
        .unwrap_or_else(|| format!("http://{}", args.bind));
    (id, url)
}

fn kept_id(data_dir: &Path) -> io::Result<String> {
    let path = data_dir.join(NODE_ID_FILE);
    match std::fs::read_to_string(&path) {
        Ok(text) if crate::run::valid_name(text.trim()) => return Ok(text.trim().to_string()),
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "{} does not hold a node id; remove it or pass --node-id",
                    path.display()
                ),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let ulid = ulid::Ulid::new().to_string().to_ascii_lowercase();
    let id = format!("node-{}", &ulid[16..]);
    let tmp = data_dir.join(format!("{NODE_ID_FILE}.tmp"));
    std::fs::write(&tmp, format!("{id}\n"))?;
    std::fs::File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, &path)?;
    Ok(id)
}

/// Who holds a rank: a node of the service, the URL it is reached at, and
/// the placement epoch it holds the rank in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub node_id: String,
    pub url: String,
    pub epoch: u64,
    /// Its engine for the rank (`cpu#1`), when known.
    pub engine: Option<String>,
}

/// A node new ranks may be placed on: its memory budget and the ranks it
/// already holds.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub node_id: String,
    pub budget: u64,
    pub held: u64,
}

/// Places `world_size` new ranks over `nodes` (in the order given, which
/// breaks ties): each rank to the node whose load, ranks held over memory
/// budget, would be lowest with it; nodes of equal budget take turns. A
/// node that reports no budget counts as the smallest one given.
pub fn assign(world_size: u32, nodes: &[Candidate]) -> Vec<String> {
    if nodes.is_empty() {
        return Vec::new();
    }
    let floor = nodes
        .iter()
        .map(|n| n.budget)
        .filter(|&b| b > 0)
        .min()
        .unwrap_or(1);
    let budget = |n: &Candidate| if n.budget == 0 { floor } else { n.budget } as f64;
    let mut held: Vec<u64> = nodes.iter().map(|n| n.held).collect();
    (0..world_size)
        .map(|_| {
            let best = (0..nodes.len())
                .min_by(|&a, &b| {
                    let la = (held[a] + 1) as f64 / budget(&nodes[a]);
                    let lb = (held[b] + 1) as f64 / budget(&nodes[b]);
                    la.total_cmp(&lb)
                })
                .expect("at least one node");
            held[best] += 1;
            nodes[best].node_id.clone()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, budget: u64, held: u64) -> Candidate {
        Candidate {
            node_id: id.into(),
            budget,
            held,
        }
    }

    #[test]
    fn ranks_are_balanced_by_count_and_budget() {
        // Equal budgets, nothing held: turns, in the order given.
        let even = [node("a", 8, 0), node("b", 8, 0), node("c", 8, 0)];
        assert_eq!(assign(4, &even), ["a", "b", "c", "a"]);
        // Ranks already held count: `a` holds three, so the others fill first.
        let busy = [node("a", 8, 3), node("b", 8, 0), node("c", 8, 1)];
        assert_eq!(assign(4, &busy), ["b", "b", "c", "b"]);
        // Twice the budget takes about twice the ranks.
        let big = [node("a", 16, 0), node("b", 8, 0)];
        let placed = assign(6, &big);
        assert_eq!(placed.iter().filter(|n| *n == "a").count(), 4);
        // No budget reported: counted as the smallest budget given.
        let unknown = [node("a", 0, 0), node("b", 8, 0)];
        assert_eq!(assign(2, &unknown), ["a", "b"]);
        assert!(assign(3, &[]).is_empty());
    }

    #[test]
    fn a_generated_id_is_kept_and_a_given_one_wins() {
        let dir = tempfile::tempdir().unwrap();
        let bound: SocketAddr = "127.0.0.1:7000".parse().unwrap();
        let mut a = ServeArgs::with(bound, dir.path().to_path_buf());
        resolve(&mut a, bound).unwrap();
        let first = a.node_id.clone().unwrap();
        assert!(first.starts_with("node-") && crate::run::valid_name(&first));
        assert_eq!(a.advertise_url.as_deref(), Some("http://127.0.0.1:7000"));
        let mut b = ServeArgs::with(bound, dir.path().to_path_buf());
        resolve(&mut b, bound).unwrap();
        assert_eq!(b.node_id, Some(first), "the id survives a restart");
        let mut bad = ServeArgs::with(bound, dir.path().to_path_buf());
        bad.node_id = Some("../up".into());
        assert!(resolve(&mut bad, bound).is_err());
        let mut c = ServeArgs::with(bound, dir.path().to_path_buf());
        c.node_id = Some("east-1".into());
        c.advertise_url = Some("http://east-1:7000".into());
        resolve(&mut c, bound).unwrap();
        assert_eq!(c.node_id.as_deref(), Some("east-1"));
        assert_eq!(c.advertise_url.as_deref(), Some("http://east-1:7000"));
        std::fs::write(dir.path().join(NODE_ID_FILE), "../x").unwrap();
        let mut d = ServeArgs::with(bound, dir.path().to_path_buf());
        assert!(resolve(&mut d, bound).is_err());
    }
}
