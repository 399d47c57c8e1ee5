//! The engines of each device: started on first use, a run's ranks placed
//! on the least loaded, given back when the run goes.

use super::handle::RunHandle;
use super::Registry;
use crate::engine::{device, EngineHandle};

impl Registry {
    /// The engines of a run's device, as (label, device): one per GPU of
    /// `--devices` for `cuda`, `--engines` threads on the CPU.
    fn labels_of(&self, device_name: &str) -> Result<Vec<(String, tch::Device)>, String> {
        device::engines_of(device_name, &self.gpus, self.cpu_engines)
    }

    /// Places a run's ranks on the engines of its device, balanced by the
    /// ranks each engine already holds (ties: the first), starting the
    /// engines on first use. Returns the engines the run uses and, per
    /// rank, its index among them.
    pub(super) fn place(
        &self,
        device_name: &str,
        world_size: u32,
        owned: &[bool],
    ) -> std::io::Result<(Vec<EngineHandle>, Vec<Option<usize>>)> {
        let engines_of = self
            .labels_of(device_name)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let cpu_engines = engines_of
            .iter()
            .filter(|(_, d)| *d == tch::Device::Cpu)
            .count();
        let labels: Vec<String> = engines_of.iter().map(|(l, _)| l.clone()).collect();
        let mut engines = self.engines.lock().expect("engines lock");
        for (label, device) in engines_of {
            // Engines sharing the CPU share its cores: each apply is split
            // over its share, so engines side by side do not oversubscribe.
            let kernel_threads = match device {
                tch::Device::Cpu if cpu_engines > 1 => {
                    (tch::get_num_threads().max(1) as usize / cpu_engines).max(1)
                }
                _ => 0,
            };
            if !engines.contains_key(&label) {
                let engine = EngineHandle::start(
                    device,
                    &label,
                    kernel_threads,
                    self.engine_queue_depth,
                    self.captures.clone(),
                    self.periodic_backlog,
                )?;
                engines.insert(label.clone(), (engine, 0));
            }
        }
        let mut used: Vec<String> = Vec::new();
        let mut by_rank = Vec::with_capacity(world_size as usize);
        for rank in 0..world_size as usize {
            if !owned.get(rank).copied().unwrap_or(false) {
                by_rank.push(None);
                continue;
            }
            let label = labels
                .iter()
                .min_by_key(|l| engines[l.as_str()].1)
                .expect("a device has an engine");
            engines.get_mut(label.as_str()).expect("engine").1 += 1;
            let i = match used.iter().position(|u| u == label) {
                Some(i) => i,
                None => {
                    used.push(label.clone());
                    used.len() - 1
                }
            };
            by_rank.push(Some(i));
        }
        let handles = used.iter().map(|l| engines[l.as_str()].0.clone()).collect();
        Ok((handles, by_rank))
    }

    /// Gives back the ranks a run held on its engines (the run is gone).
    pub(super) fn unplace(&self, run: &RunHandle) {
        let mut engines = self.engines.lock().expect("engines lock");
        for label in run.engines.labels().into_iter().flatten() {
            if let Some((_, held)) = engines.get_mut(&label) {
                *held = held.saturating_sub(1);
            }
        }
    }

    /// The engines this server runs or would start for its default device,
    /// and any other it started (`cpu#0`, `cuda:1`, ...), sorted.
    pub fn engine_labels(&self) -> Vec<String> {
        let mut labels: Vec<String> = self
            .labels_of(&self.default_device)
            .map(|e| e.into_iter().map(|(l, _)| l).collect())
            .unwrap_or_default();
        for engine in self.engines() {
            if !labels.iter().any(|l| l == engine.label()) {
                labels.push(engine.label().to_string());
            }
        }
        labels.sort();
        labels
    }

    pub fn engines(&self) -> Vec<EngineHandle> {
        let engines = self.engines.lock().expect("engines lock");
        let mut out: Vec<_> = engines.values().map(|(e, _)| e.clone()).collect();
        out.sort_by(|a, b| a.label().cmp(b.label()));
        out
    }
}
