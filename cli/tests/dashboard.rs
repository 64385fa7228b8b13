//! The Grafana dashboard in k8s/grafana names only metrics the services declare (and document):
//! a renamed metric must not leave a panel silently empty.

use std::collections::BTreeSet;

use serde_json::Value;

const DASHBOARD: &str = include_str!("../../k8s/grafana/strata-dashboard.json");
const ALERTS: &str = include_str!("../../k8s/prometheus/strata-alerts.yaml");
/// Where metric names are declared, once each (see docs/METRICS.md).
const SOURCES: &[&str] = &[
    include_str!("../../cache-master/src/metrics_defs.rs"),
    include_str!("../../cache-worker/src/metrics_defs.rs"),
    include_str!("../../client-sdk/src/lib.rs"),
    include_str!("../../client-sdk/src/outage.rs"),
    include_str!("../../client-sdk/src/rdma.rs"),
    include_str!("../../client-sdk/src/shortcircuit.rs"),
];
const METRICS_DOC: &str = include_str!("../../docs/METRICS.md");

/// Every `strata_…` identifier in `text`.
fn metric_names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("strata_") {
        let before_ok =
            i == 0 || !rest.as_bytes()[i - 1].is_ascii_alphanumeric() && rest.as_bytes()[i - 1] != b'_';
        let name: String = rest[i..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if before_ok {
            out.push(name.clone());
        }
        rest = &rest[i + name.len().max(1)..];
    }
    out
}

/// The names declared as string constants (`"strata_…"`) in the sources.
fn declared() -> BTreeSet<String> {
    SOURCES
        .iter()
        .flat_map(|src| src.split('"').skip(1).step_by(2))
        .filter(|lit| lit.starts_with("strata_") && lit.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        .map(String::from)
        .collect()
}

fn exprs(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match (k.as_str(), v) {
                    ("expr", Value::String(e)) => out.push(e.clone()),
                    _ => exprs(v, out),
                }
            }
        }
        Value::Array(a) => a.iter().for_each(|v| exprs(v, out)),
        _ => {}
    }
}

#[test]
fn every_dashboard_expression_names_a_declared_and_documented_metric() {
    let declared = declared();
    assert!(declared.len() > 40, "the declarations were found ({})", declared.len());
    let dashboard: Value = serde_json::from_str(DASHBOARD).expect("the dashboard is JSON");
    let panels = dashboard["panels"].as_array().expect("panels");
    assert!(!panels.is_empty());
    let mut used = BTreeSet::new();
    for panel in panels {
        let title = panel["title"].as_str().unwrap_or_default();
        let mut found = Vec::new();
        exprs(panel, &mut found);
        assert!(!title.is_empty() && !found.is_empty(), "a panel without a title or a query: {panel}");
        for expr in found {
            let names = metric_names(&expr);
            assert!(!names.is_empty(), "{title}: {expr} names no strata metric");
            for name in names {
                // A histogram is exported as its _bucket, _sum and _count series.
                let base = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| name.strip_suffix(s).filter(|b| declared.contains(*b)))
                    .unwrap_or(&name);
                assert!(declared.contains(base), "{title}: {name} is not a metric any service declares");
                used.insert(base.to_string());
            }
        }
    }
    for name in &used {
        assert!(METRICS_DOC.contains(&format!("`{name}`")), "{name} is not documented in docs/METRICS.md");
    }
    // The areas an operator looks at first are all on it.
    for must in [
        "strata_worker_tier_used_bytes",
        "strata_worker_cache_hits_total",
        "strata_worker_ufs_bytes_total",
        "strata_master_pins",
        "strata_worker_upstream_reads_total",
        "strata_worker_load_blocks_total",
    ] {
        assert!(used.contains(must), "the dashboard shows nothing of {must}");
    }
}

#[test]
fn every_alert_names_a_declared_and_documented_metric_and_says_what_is_wrong() {
    let declared = declared();
    // One rule per `- alert:` line, up to the next.
    let rules: Vec<&str> = ALERTS.split("      - alert: ").skip(1).collect();
    assert!(rules.len() >= 6, "the rules were found ({})", rules.len());
    for rule in rules {
        let name = rule.lines().next().unwrap_or_default();
        let expr = rule
            .lines()
            .find_map(|l| l.trim().strip_prefix("expr: "))
            .unwrap_or_else(|| panic!("{name} has no expr"));
        assert!(rule.contains("summary: "), "{name} has no summary");
        assert!(rule.contains("severity: "), "{name} has no severity");
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{name}: {expr} names no strata metric");
        for metric in names {
            assert!(declared.contains(&metric), "{name}: {metric} is not a metric any service declares");
            assert!(METRICS_DOC.contains(&format!("`{metric}`")), "{name}: {metric} is not documented");
        }
    }
    assert!(ALERTS.contains("strata_worker_nvme_write_errors_total"), "the full disk has an alert");
}

#[test]
fn every_declared_metric_is_documented() {
    for name in declared() {
        assert!(METRICS_DOC.contains(&format!("`{name}`")), "{name} is declared but not in docs/METRICS.md");
    }
}

#[test]
fn metric_names_are_found_in_expressions() {
    assert_eq!(
        metric_names("sum(rate(strata_worker_a_total[5m])) / x_strata_no + strata_b_bucket"),
        ["strata_worker_a_total", "strata_b_bucket"]
    );
}
