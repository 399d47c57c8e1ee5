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

#[cfg(test)]
mod tests {
    use super::*;

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
