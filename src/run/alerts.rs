//! A run's alert rules: what the server watches for it, part of the run's
//! configuration (checked field by field like the rest of it). The alerts
//! service evaluates them.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::FieldError;

/// A run's alert rules. Every field has a default, so `{}` keeps the
/// defaults: stale ranks, rejected non-finite pushes, failed snapshots and
/// a disk under 5% free alert; metric rules and the webhook are opt-in.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AlertRules {
    /// Seconds without a push after which a rank alerts; default the rank's
    /// own stale threshold (`stale_after_seconds` of the rank); 0 turns it off.
    #[serde(default)]
    pub stale_after_seconds: Option<f64>,
    /// Alert when a push is rejected for NaN/Inf values.
    #[serde(default = "yes")]
    pub nonfinite: bool,
    /// Alert when a snapshot fails.
    #[serde(default = "yes")]
    pub snapshot_failed: bool,
    /// Alert when the data directory's free space falls below this fraction
    /// of the disk (0 turns it off).
    #[serde(default = "default_disk_free")]
    pub disk_free_below: f64,
    /// Rules on the trainer's (or the server's) metric series.
    #[serde(default)]
    pub metrics: Vec<MetricRule>,
    /// `http://` URL that receives every alert transition as JSON.
    #[serde(default)]
    pub webhook: Option<String>,
}

fn yes() -> bool {
    true
}

fn default_disk_free() -> f64 {
    0.05
}

impl Default for AlertRules {
    fn default() -> Self {
        AlertRules {
            stale_after_seconds: None,
            nonfinite: true,
            snapshot_failed: true,
            disk_free_below: default_disk_free(),
            metrics: Vec::new(),
            webhook: None,
        }
    }
}

/// A rule on one metric series: a threshold crossed, or no improvement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MetricRule {
    /// Series name, e.g. `loss`.
    pub metric: String,
    /// Only points of this rank; default the run-level points.
    #[serde(default)]
    pub rank: Option<u32>,
    /// Fires while the value is above this.
    #[serde(default)]
    pub above: Option<f64>,
    /// Fires while the value is below this.
    #[serde(default)]
    pub below: Option<f64>,
    /// Fires when the best value is this many steps old.
    #[serde(default)]
    pub patience: Option<u64>,
    /// `min` (default: lower is better) or `max`.
    #[serde(default)]
    pub mode: Goal,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Goal {
    #[default]
    Min,
    Max,
}

impl AlertRules {
    /// Checks the rules; `prefix` names the field in errors.
    pub fn validate(&self, prefix: &str) -> Result<(), FieldError> {
        let err = |field: String, message: &str| FieldError {
            field: format!("{prefix}{field}"),
            message: message.to_string(),
        };
        if let Some(s) = self.stale_after_seconds {
            if !s.is_finite() || s < 0.0 {
                return Err(err(".stale_after_seconds".into(), "must be >= 0"));
            }
        }
        if !(0.0..=1.0).contains(&self.disk_free_below) {
            return Err(err(".disk_free_below".into(), "must be in [0, 1]"));
        }
        if let Some(url) = &self.webhook {
            let rest = url.strip_prefix("http://").unwrap_or("");
            if rest.is_empty() || url.len() > 2048 || url.chars().any(char::is_whitespace) {
                return Err(err(".webhook".into(), "must be an http:// URL"));
            }
        }
        if self.metrics.len() > 64 {
            return Err(err(".metrics".into(), "at most 64 rules"));
        }
        for (i, m) in self.metrics.iter().enumerate() {
            if !valid_metric_name(&m.metric) {
                return Err(err(format!(".metrics[{i}].metric"), "not a metric name"));
            }
            if m.above.is_some_and(|v| !v.is_finite()) || m.below.is_some_and(|v| !v.is_finite()) {
                return Err(err(format!(".metrics[{i}]"), "thresholds must be finite"));
            }
            if m.patience == Some(0) {
                return Err(err(format!(".metrics[{i}].patience"), "must be >= 1"));
            }
            if m.above.is_none() && m.below.is_none() && m.patience.is_none() {
                return Err(err(
                    format!(".metrics[{i}]"),
                    "needs `above`, `below` or `patience`",
                ));
            }
        }
        Ok(())
    }
}

/// Every alert kind.
pub const KINDS: [&str; 9] = [
    "stale_rank",
    "nonfinite",
    "metric_above",
    "metric_below",
    "no_improvement",
    "disk_full",
    "snapshot_failed",
    "snapshot_corrupt",
    "steps_lost",
];

/// Whether the server may send to `url` under `--webhook-allow`: any host
/// when the list is empty, else only a listed `host` (any port) or
/// `host:port`, compared without case.
pub fn webhook_allowed(url: &str, allow: &[String]) -> bool {
    let allow: Vec<&str> = allow
        .iter()
        .map(|a| a.trim())
        .filter(|a| !a.is_empty())
        .collect();
    if allow.is_empty() {
        return true;
    }
    let Ok(parsed) = url::Url::parse(url) else {
        return false;
    };
    let Some(host) = parsed.host_str() else {
        return false;
    };
    let port = parsed.port_or_known_default().unwrap_or(80);
    let with_port = format!("{host}:{port}");
    allow
        .iter()
        .any(|a| a.eq_ignore_ascii_case(host) || a.eq_ignore_ascii_case(&with_port))
}

/// Checks a metric name: 1..=128 printable characters.
pub fn valid_metric_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 128 && name.chars().all(|c| !c.is_control())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn webhooks_go_only_to_allowed_hosts() {
        let url = "http://hooks.example:8080/alerts";
        assert!(webhook_allowed(url, &[]));
        assert!(webhook_allowed(url, &[" ".into()]));
        assert!(webhook_allowed(url, &["HOOKS.example".into()]));
        assert!(webhook_allowed(
            url,
            &["x".into(), "hooks.example:8080".into()]
        ));
        assert!(!webhook_allowed(url, &["hooks.example:80".into()]));
        assert!(!webhook_allowed(url, &["evil.example".into()]));
        assert!(!webhook_allowed(
            "http://hooks.example.evil.example/",
            &["hooks.example".into()]
        ));
        assert!(!webhook_allowed(
            "http://169.254.169.254/",
            &["hooks.example".into()]
        ));
    }

    #[test]
    fn metric_names_are_short_and_printable() {
        assert!(valid_metric_name("loss/train"));
        assert!(!valid_metric_name(""));
        assert!(!valid_metric_name("a\nb"));
        assert!(!valid_metric_name(&"x".repeat(129)));
    }
}
