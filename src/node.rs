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

/// A rank taken over from a node that was gone, or restored by its own node
/// after a restart (a crash, an OOM kill, a reboot: a failover to itself):
/// where it was restored from and, once its trainer pushed again, what was
/// lost in between.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
pub struct Failover {
    /// The node that held the rank (after a restart: this node itself), and
    /// the epoch its owner holds it in now.
    pub from_node: String,
    /// The rank's own node restarted and restored it (`false`: another
    /// node took it over from a node that was gone).
    #[serde(default)]
    pub restart: bool,
    pub epoch: u64,
    pub at_ms: i64,
    /// The snapshot the EMA was restored from and the rank's step in it;
    /// `None` when no snapshot held the rank (its EMA starts again from
    /// the next push).
    pub snapshot: Option<String>,
    pub restored_step: Option<u64>,
    /// The last step the catalog had seen the rank at (the lost node may
    /// have applied later ones before it stopped).
    pub last_seen_step: Option<u64>,
    /// The first step the new owner applied; with `lost_steps`, set by the
    /// first push after the failover.
    pub resumed_step: Option<u64>,
    /// Update steps between `restored_step` and `resumed_step` that the EMA
    /// does not have: applied by the lost node after its last snapshot, or
    /// never pushed again.
    pub lost_steps: Option<u64>,
}

impl Failover {
    /// The first push after the failover, at `step`: the update steps the
    /// EMA misses, those after the restored step and before `step` (every
    /// `update_every`-th step counts; with no restored state, every update
    /// step before `step`).
    pub fn resumed_at(&mut self, step: u64, update_every: u64) {
        let every = update_every.max(1);
        // Update steps in [from, step): multiples of `every`.
        let from = self.restored_step.map_or(0, |r| r + 1);
        let count = |n: u64| n.div_ceil(every);
        self.resumed_step = Some(step);
        self.lost_steps = Some(count(step).saturating_sub(count(from)));
    }
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

/// Part of the lease after its last renewal was sent past which this node
/// stops acknowledging pushes (when another node could take its ranks):
/// the others see the lease expire only a whole lease after the catalog
/// recorded that renewal, which is after it was sent.
const FENCE_AT: f64 = 5.0 / 6.0;

/// This node's hold on its ranks. Pushes are acknowledged only while the
/// last lease renewal the catalog took was sent less than [`FENCE_AT`] of
/// a lease ago, when the service has other nodes (that could take the
/// ranks over once the lease expires): a node cut off from the catalog
/// stops before any other may start, so no rank ever has two nodes
/// applying its pushes. A node alone keeps going through a catalog outage.
pub struct Lease {
    origin: std::time::Instant,
    lease: std::time::Duration,
    /// Milliseconds after `origin` at which the last renewal the catalog
    /// took was sent.
    sent_ms: std::sync::atomic::AtomicU64,
    /// Whether the service had other live nodes at the last renewal.
    shared: std::sync::atomic::AtomicBool,
}

impl Lease {
    /// A lease of `lease_secs`, taken now (at registration).
    pub fn new(lease_secs: f64) -> Self {
        Lease {
            origin: std::time::Instant::now(),
            lease: std::time::Duration::from_secs_f64(lease_secs),
            sent_ms: 0.into(),
            shared: false.into(),
        }
    }

    /// The catalog took the renewal sent at `sent`; `others`: whether it
    /// lists other live nodes.
    pub fn renewed(&self, sent: std::time::Instant, others: bool) {
        use std::sync::atomic::Ordering;
        let ms = sent.saturating_duration_since(self.origin).as_millis() as u64;
        self.sent_ms.fetch_max(ms, Ordering::AcqRel);
        self.shared.store(others, Ordering::Release);
    }

    /// How long ago the last renewal the catalog took was sent.
    pub fn age(&self) -> std::time::Duration {
        let sent = self.sent_ms.load(std::sync::atomic::Ordering::Acquire);
        self.origin
            .elapsed()
            .saturating_sub(std::time::Duration::from_millis(sent))
    }

    /// `Some(age)` when this node must not acknowledge a push: the service
    /// has other nodes and the lease is too old to be sure it still holds.
    pub fn fenced(&self) -> Option<std::time::Duration> {
        if !self.shared.load(std::sync::atomic::Ordering::Acquire) {
            return None;
        }
        let age = self.age();
        (age.as_secs_f64() >= self.lease.as_secs_f64() * FENCE_AT).then_some(age)
    }

    /// Whether the lease is old enough to fence pushes (were the service
    /// shared): another node may have taken this one's ranks since.
    pub fn lapsed(&self) -> bool {
        self.age().as_secs_f64() >= self.lease.as_secs_f64() * FENCE_AT
    }

    /// The lease's length.
    pub fn length(&self) -> std::time::Duration {
        self.lease
    }
}

#[cfg(test)]
mod lease_tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_lease_fences_before_it_runs_out_only_when_shared() {
        let lease = Lease::new(0.6);
        assert!(lease.fenced().is_none());
        std::thread::sleep(Duration::from_millis(550));
        // Alone: never fenced, however old the lease.
        assert!(lease.fenced().is_none());
        // Renewed (sent 520 ms ago), with other nodes: fenced at 500 ms.
        let sent = Instant::now() - Duration::from_millis(520);
        lease.renewed(sent, true);
        let age = lease.fenced().expect("fenced past 5/6 of the lease");
        assert!(age >= Duration::from_millis(500) && age < Duration::from_millis(600));
        // A fresh renewal lifts it; an older one arriving late does not undo it.
        lease.renewed(Instant::now(), true);
        assert!(lease.fenced().is_none());
        lease.renewed(sent, true);
        assert!(lease.fenced().is_none());
        std::thread::sleep(Duration::from_millis(520));
        assert!(lease.fenced().is_some());
    }
}
