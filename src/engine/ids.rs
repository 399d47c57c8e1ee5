//! Snapshot ids.

use crate::contract::SnapshotKind;

/// A new snapshot id: a ULID in lower case (26 characters, 48 bits of
/// milliseconds then 80 random bits), unique across runs and servers and
/// ordered by creation time as a string; safe as a path component. Ids
/// made in the same millisecond by this process increase by one, so they
/// stay ordered too. (Catalogs written before keep their
/// `<kind>-<step>-<4 hex>` ids: ids are opaque everywhere else.)
pub fn snapshot_id(_kind: SnapshotKind, _step: u64) -> String {
    static GENERATOR: std::sync::Mutex<ulid::Generator> =
        std::sync::Mutex::new(ulid::Generator::new());
    let mut generator = GENERATOR.lock().unwrap_or_else(|e| e.into_inner());
    let id = match generator.generate() {
        Ok(id) => id,
        // 2^80 ids in one millisecond: start a fresh random sequence.
        Err(_) => ulid::Ulid::new(),
    };
    id.to_string().to_ascii_lowercase()
}

#[cfg(test)]
mod tests {
    use super::{snapshot_id, SnapshotKind};

    /// 100,000 ids made by four threads (as runs on different engines and
    /// tasks would): all distinct, and every thread's ids increase, so
    /// sorting ids sorts snapshots by creation; the time part is now.
    #[test]
    fn ids_are_unique_and_ordered_by_creation() {
        let before = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let threads: Vec<_> = (0..4)
            .map(|t| {
                std::thread::spawn(move || {
                    (0..25_000)
                        .map(|i| {
                            snapshot_id(
                                [SnapshotKind::Manual, SnapshotKind::State][(i + t) % 2],
                                i as u64,
                            )
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let per_thread: Vec<Vec<String>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let mut all = std::collections::HashSet::new();
        for ids in &per_thread {
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "ids not increasing");
            for id in ids {
                assert_eq!(id.len(), 26);
                assert!(id
                    .bytes()
                    .all(|b| b.is_ascii_digit() || b.is_ascii_lowercase()));
                assert!(all.insert(id.clone()), "duplicate id {id}");
            }
        }
        assert_eq!(all.len(), 100_000);
        // The first 10 characters are the creation time in milliseconds.
        let first = ulid::Ulid::from_string(&per_thread[0][0].to_ascii_uppercase()).unwrap();
        let last = ulid::Ulid::from_string(&per_thread[0][24_999].to_ascii_uppercase()).unwrap();
        assert!(first.timestamp_ms() >= before && last.timestamp_ms() >= first.timestamp_ms());
        // One id made after all the others sorts after every one of them.
        let later = snapshot_id(SnapshotKind::Manual, 0);
        assert!(all.iter().all(|id| *id < later));
    }
}
