//! OpenLineage run events from a job's lineage (`strata lineage export`).
//!
//! A Strata job is one long-lived name whose reads are cut into segments by the marks it makes
//! (an epoch, a checkpoint). Each segment becomes one OpenLineage run of the job: a START and a
//! COMPLETE event carrying the exact object versions the segment read as input datasets, so a
//! lineage store (Marquez, ...) can answer "which data trained checkpoint N". The schemas the
//! events follow are checked in under `docs/openlineage/` (see its README).

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Value, json};
use strata_proto::{LineageJobResponse, LineageMark, LineageRecord};

/// The spec version the events follow: the `$id` of docs/openlineage/OpenLineage.json.
const RUN_EVENT_SCHEMA_URL: &str = "https://openlineage.io/spec/2-0-2/OpenLineage.json#/$defs/RunEvent";
const DATASET_VERSION_SCHEMA_URL: &str = "https://openlineage.io/spec/facets/1-0-1/DatasetVersionDatasetFacet.json#/$defs/DatasetVersionDatasetFacet";
const INPUT_STATISTICS_SCHEMA_URL: &str = "https://openlineage.io/spec/facets/1-0-0/InputStatisticsInputDatasetFacet.json#/$defs/InputStatisticsInputDatasetFacet";
const STRATA_MARK_SCHEMA_URL: &str = "https://github.com/strata-cache/strata/blob/main/docs/openlineage/StrataMarkRunFacet.json#/$defs/StrataMarkRunFacet";
const STRATA_READ_SCHEMA_URL: &str = "https://github.com/strata-cache/strata/blob/main/docs/openlineage/StrataReadInputDatasetFacet.json#/$defs/StrataReadInputDatasetFacet";

/// The UUID namespace of Strata's run ids: uuid5(NAMESPACE_URL,
/// "https://github.com/strata-cache/strata/blob/main/docs/openlineage/README.md#run-ids").
/// Fixed forever: changing it would give every exported run a new identity.
const RUN_ID_NAMESPACE: [u8; 16] =
    [0x5b, 0x7a, 0xe0, 0xed, 0x8e, 0x3c, 0x58, 0xd8, 0x92, 0x65, 0x8d, 0xcd, 0xf1, 0x42, 0x42, 0x08];

/// How long an error answer's body may be in an error message: enough for Marquez's JSON
/// complaint, not a whole HTML error page.
const MAX_ERROR_BODY: usize = 512;

/// Whose events they are: the job's namespace and the producer they name.
pub struct ExportOptions {
    /// The OpenLineage job namespace (the caller's default is "strata").
    pub namespace: String,
    /// URI of the producer, e.g. "https://github.com/strata-cache/strata/tree/v0.1.0".
    pub producer: String,
}

/// One OpenLineage run per segment (the reads between two marks, seq 0 first), each as a START
/// event (eventTime = the segment's first read, or the mark's at_ms when the mark is known) and
/// a COMPLETE event (eventTime = the segment's last read), both with the same deterministic
/// runId (a UUID derived from namespace, job name and segment seq, so exporting twice yields
/// the same ids) and the segment's input datasets. Segments without reads give no run.
///
/// `job` should hold all the job's pages: a segment split over two calls would be exported as
/// two runs with the same runId, each with part of the inputs.
pub fn run_events(job: &LineageJobResponse, opts: &ExportOptions) -> Vec<Value> {
    // The master records an empty job name as `anonymous`; lineage stores refuse a blank job
    // name, so use the master's name for it rather than export a nameless job.
    let job_name = if job.job.is_empty() { "anonymous" } else { job.job.as_str() };
    let marks: BTreeMap<u64, &LineageMark> = job.marks.iter().map(|m| (m.seq, m)).collect();
    let mut segments: BTreeMap<u64, Vec<&LineageRecord>> = BTreeMap::new();
    for record in &job.records {
        segments.entry(record.mark_seq).or_default().push(record);
    }

    let mut events = Vec::with_capacity(segments.len() * 2);
    for (seq, records) in segments {
        let mark = if seq == 0 { None } else { marks.get(&seq).copied() };
        let first_read = records.iter().map(|r| r.first_read_ms).min().unwrap_or_default();
        let last_read = records.iter().map(|r| r.last_read_ms).max().unwrap_or_default();
        let start_ms = mark.map_or(first_read, |m| m.at_ms);
        // The mark's time and the reads' come from different clocks (the master's, clients'
        // corrected ones); a run must not complete before it started.
        let complete_ms = last_read.max(start_ms);

        let run = json!({
            "runId": run_id(&opts.namespace, job_name, seq),
            "facets": { "strata_mark": mark_facet(seq, mark, opts) },
        });
        let job_ref = json!({ "namespace": opts.namespace, "name": job_name });
        // START carries the inputs too: the export happens after the fact, so they are known,
        // and the spec's lifecycle asks for known inputs at START. It also keeps each event
        // complete on its own should a consumer drop the other.
        let inputs = input_datasets(&records, opts);
        for (event_type, at_ms) in [("START", start_ms), ("COMPLETE", complete_ms)] {
            events.push(json!({
                "eventType": event_type,
                "eventTime": iso_time(at_ms),
                "producer": opts.producer,
                "schemaURL": RUN_EVENT_SCHEMA_URL,
                "run": run.clone(),
                "job": job_ref.clone(),
                "inputs": inputs.clone(),
                "outputs": [],
            }));
        }
    }
    events
}

/// POSTs each event as its own JSON body (Content-Type: application/json) to `url` (Marquez:
/// http://host:5000/api/v1/lineage), in order, failing with a clear error naming the event
/// index and the HTTP status on the first non-2xx answer or a timeout; returns how many were
/// sent. `timeout` bounds each event's request, not the whole export.
pub async fn post_events(url: &str, events: &[Value], timeout: Duration) -> Result<usize> {
    let endpoint = reqwest::Url::parse(url).with_context(|| format!("{url:?} is not a URL"))?;
    if !matches!(endpoint.scheme(), "http" | "https") {
        bail!("{url:?}: only http:// and https:// lineage endpoints are supported");
    }
    let client = reqwest::Client::builder().timeout(timeout).build().context("setting up the HTTP client")?;
    let total = events.len();
    for (index, event) in events.iter().enumerate() {
        // Says which run failed and that the events before it went through, so a user can
        // tell what the lineage store already holds.
        let which = || {
            let event_type = event["eventType"].as_str().unwrap_or("?");
            let run_id = event["run"]["runId"].as_str().unwrap_or("?");
            format!(
                "OpenLineage event {index} (0-based) of {total}, {event_type} of run {run_id} \
                 ({index} sent before it)"
            )
        };
        let body = serde_json::to_vec(event).with_context(|| format!("encoding {}", which()))?;
        let response = client
            .post(endpoint.clone())
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body)
            .send()
            .await
            .map_err(|e| {
                if e.is_timeout() {
                    anyhow!("{}: no answer from {url} within {timeout:?}", which())
                } else {
                    anyhow!(e).context(format!("{}: POST {url} failed", which()))
                }
            })?;
        let status = response.status();
        if !status.is_success() {
            // The body usually says what the store disliked (Marquez: which field); best effort.
            let text = response.text().await.unwrap_or_default();
            let text = text.trim();
            let detail = if text.is_empty() {
                String::new()
            } else {
                let cut: String = text.chars().take(MAX_ERROR_BODY).collect();
                let more = if cut.len() < text.len() { "..." } else { "" };
                format!(": {cut}{more}")
            };
            bail!("{}: {url} answered HTTP {status}{detail}", which());
        }
    }
    Ok(total)
}

/// The run's `strata_mark` facet: which segment of the job the run is.
fn mark_facet(seq: u64, mark: Option<&LineageMark>, opts: &ExportOptions) -> Value {
    json!({
        "_producer": opts.producer,
        "_schemaURL": STRATA_MARK_SCHEMA_URL,
        "seq": seq,
        "label": mark.map(|m| m.label.as_str()),
        "at": mark.map(|m| iso_time(m.at_ms)),
    })
}

/// A segment's reads summed per dataset version: one record per reader (and per flush window
/// merged on the master) becomes one input, as OpenLineage has no notion of readers.
#[derive(Default)]
struct ReadSum<'a> {
    path: &'a str,
    bytes: u64,
    reads: u64,
    first_ms: i64,
    last_ms: i64,
}

fn input_datasets(records: &[&LineageRecord], opts: &ExportOptions) -> Vec<Value> {
    let mut sums: BTreeMap<(String, String, &str), ReadSum> = BTreeMap::new();
    for r in records {
        let (namespace, name) = dataset_id(&r.ufs, &r.path);
        let sum = sums.entry((namespace, name, r.version.as_str())).or_insert_with(|| ReadSum {
            path: &r.path,
            first_ms: r.first_read_ms,
            last_ms: r.last_read_ms,
            ..ReadSum::default()
        });
        // Two mounts of the same store can name one object by two Strata paths; keep the
        // smallest so the export does not depend on record order.
        sum.path = sum.path.min(r.path.as_str());
        sum.bytes = sum.bytes.saturating_add(r.bytes);
        sum.reads = sum.reads.saturating_add(r.reads);
        sum.first_ms = sum.first_ms.min(r.first_read_ms);
        sum.last_ms = sum.last_ms.max(r.last_read_ms);
    }
    sums.into_iter()
        .map(|((namespace, name, version), sum)| {
            let mut facets = serde_json::Map::new();
            // An empty version would claim a version that is not one; say nothing instead.
            if !version.is_empty() {
                facets.insert(
                    "version".into(),
                    json!({
                        "_producer": opts.producer,
                        "_schemaURL": DATASET_VERSION_SCHEMA_URL,
                        "datasetVersion": version,
                    }),
                );
            }
            json!({
                "namespace": namespace,
                "name": name,
                "facets": facets,
                "inputFacets": {
                    // The standard facet, for consumers that know nothing of Strata's.
                    "inputStatistics": {
                        "_producer": opts.producer,
                        "_schemaURL": INPUT_STATISTICS_SCHEMA_URL,
                        "size": sum.bytes,
                        "fileCount": 1,
                    },
                    "strata_read": {
                        "_producer": opts.producer,
                        "_schemaURL": STRATA_READ_SCHEMA_URL,
                        "path": sum.path,
                        "bytes": sum.bytes,
                        "reads": sum.reads,
                        "firstRead": iso_time(sum.first_ms),
                        "lastRead": iso_time(sum.last_ms),
                    },
                },
            })
        })
        .collect()
}

/// The OpenLineage dataset (namespace, name) of an object at `ufs`, after the spec's naming
/// conventions (website/docs/spec/naming.md in the OpenLineage repository) so Strata's
/// datasets are the same nodes other producers (Spark, Airflow) report for the same objects.
/// Without a usable UFS URI the dataset is the file in Strata's own namespace.
fn dataset_id(ufs: &str, path: &str) -> (String, String) {
    let fallback = || ("strata".to_string(), path.to_string());
    let Some((scheme, rest)) = ufs.split_once("://") else { return fallback() };
    let valid_scheme = scheme.starts_with(|c: char| c.is_ascii_alphabetic())
        && scheme.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'));
    if !valid_scheme {
        return fallback();
    }
    let scheme = scheme.to_ascii_lowercase();
    let (authority, object_path) = rest.find('/').map_or((rest, ""), |i| rest.split_at(i));
    // A path names the root as "/", never as nothing (the spec's reference client does the same).
    let non_empty = |p: &str| if p.is_empty() { "/".to_string() } else { p.to_string() };
    match scheme.as_str() {
        // Local files: namespace `file` and the absolute path; another host's: `file://host`.
        "file" if authority.is_empty() || authority == "localhost" => {
            ("file".to_string(), non_empty(object_path))
        }
        "file" => (format!("file://{authority}"), non_empty(object_path)),
        // Object stores: the bucket is the namespace, the key (no leading slash) the name.
        // Strata's `gcs://` is the spec's `gs://`, and s3a/s3n name S3 objects as Hadoop does.
        "s3" | "s3a" | "s3n" | "gs" | "gcs" | "oss" | "azblob" | "wasbs" | "abfss" => {
            if authority.is_empty() {
                return fallback();
            }
            let scheme = match scheme.as_str() {
                "s3a" | "s3n" => "s3",
                "gcs" => "gs",
                other => other,
            };
            let key = object_path.strip_prefix('/').unwrap_or(object_path);
            (format!("{scheme}://{authority}"), non_empty(key))
        }
        // File systems with a host (hdfs://namenode:8020, webhdfs://...): the absolute path.
        _ => (format!("{scheme}://{authority}"), non_empty(object_path)),
    }
}

/// RFC 3339 in UTC with milliseconds, as the spec's `date-time` wants.
fn iso_time(ms: i64) -> String {
    // Out of chrono's range only for a corrupt record; the epoch makes it visibly wrong
    // without failing the whole export.
    DateTime::<Utc>::from_timestamp_millis(ms)
        .unwrap_or(DateTime::UNIX_EPOCH)
        .to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// The run id of one segment of one job: a UUID version 5 (RFC 9562), so exporting twice gives
/// the same ids (a lineage store merges rather than duplicates the runs) and anyone can derive
/// it: `uuid.uuid5(RUN_ID_NAMESPACE, f"{namespace}\0{job}\0{seq}")` in Python. The OpenLineage
/// namespace is part of it so two clusters exporting the same job name under different
/// namespaces do not collide. NUL separates the parts because no job name or namespace
/// holds one (both come from environment variables or arguments).
fn run_id(namespace: &str, job: &str, seq: u64) -> String {
    uuid::Uuid::new_v5(
        &uuid::Uuid::from_bytes(RUN_ID_NAMESPACE),
        format!("{namespace}\0{job}\0{seq}").as_bytes(),
    )
    .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
    use tokio::net::TcpListener;
    use tokio::sync::mpsc;

    const T0: i64 = 1_796_487_600_000; // 2026-12-05T16:20:00Z

    fn opts() -> ExportOptions {
        ExportOptions {
            namespace: "strata".into(),
            producer: "https://github.com/strata-cache/strata/tree/v0.1.0".into(),
        }
    }

    fn record(path: &str, version: &str, ufs: &str, seq: u64, first: i64, last: i64) -> LineageRecord {
        LineageRecord {
            job: "train-resnet".into(),
            path: path.into(),
            version: version.into(),
            ufs: ufs.into(),
            bytes: 1000,
            reads: 10,
            first_read_ms: first,
            last_read_ms: last,
            mark_seq: seq,
            reader: "-".into(),
        }
    }

    fn mark(seq: u64, label: &str, at_ms: i64) -> LineageMark {
        LineageMark { job: "train-resnet".into(), seq, label: label.into(), at_ms }
    }

    /// Two marks and reads in each of the three segments; a third mark with no reads after it.
    fn sample() -> LineageJobResponse {
        let mut reader_b =
            record("/data/a.bin", "\"etag-a1\"", "s3://bucket/prefix/a.bin", 0, T0 + 50, T0 + 900);
        reader_b.reader = "tok-b".into();
        LineageJobResponse {
            job: "train-resnet".into(),
            marks: vec![
                mark(1, "epoch-1", T0 + 1_000),
                mark(2, "epoch-2", T0 + 2_000),
                mark(3, "idle", T0 + 9_000),
            ],
            // Out of order on purpose: the export orders by segment, not by record.
            records: vec![
                record(
                    "/hdfs/w/b.bin",
                    "17",
                    "hdfs://namenode:8020/warehouse/b.bin",
                    2,
                    T0 + 2_100,
                    T0 + 2_500,
                ),
                record("/data/a.bin", "\"etag-a1\"", "s3://bucket/prefix/a.bin", 0, T0 + 100, T0 + 800),
                reader_b,
                record("/local/x/a.bin", "mtime-42", "file:///tmp/x/a.bin", 1, T0 + 1_200, T0 + 1_700),
                record("/data/a.bin", "\"etag-a2\"", "s3://bucket/prefix/a.bin", 1, T0 + 1_100, T0 + 1_300),
                record("/mem/c.bin", "v1", "", 2, T0 + 2_200, T0 + 2_300),
            ],
            next_page_token: String::new(),
        }
    }

    fn is_uuid_v5(s: &str) -> bool {
        let groups: Vec<&str> = s.split('-').collect();
        groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12])
            && groups.iter().all(|g| g.chars().all(|c| matches!(c, '0'..='9' | 'a'..='f')))
            && groups[2].starts_with('5')
            && groups[3].starts_with(['8', '9', 'a', 'b'])
    }

    fn input<'a>(event: &'a Value, namespace: &str, name: &str) -> &'a Value {
        event["inputs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|d| d["namespace"] == namespace && d["name"] == name)
            .unwrap_or_else(|| panic!("no input {namespace} {name} in {event:#}"))
    }

    #[test]
    fn one_run_per_segment_with_start_and_complete() {
        let events = run_events(&sample(), &opts());
        let shape: Vec<(&str, u64)> = events
            .iter()
            .map(|e| {
                (e["eventType"].as_str().unwrap(), e["run"]["facets"]["strata_mark"]["seq"].as_u64().unwrap())
            })
            .collect();
        assert_eq!(
            shape,
            [("START", 0), ("COMPLETE", 0), ("START", 1), ("COMPLETE", 1), ("START", 2), ("COMPLETE", 2)]
        );

        let ids: Vec<&str> = events.iter().map(|e| e["run"]["runId"].as_str().unwrap()).collect();
        assert!(ids.iter().all(|id| is_uuid_v5(id)), "{ids:?}");
        for pair in ids.chunks(2) {
            assert_eq!(pair[0], pair[1], "START and COMPLETE of a run share its id");
        }
        assert!(ids[0] != ids[2] && ids[2] != ids[4] && ids[0] != ids[4], "{ids:?}");

        let again = run_events(&sample(), &opts());
        assert_eq!(events, again, "exporting twice gives the same events");
        // Another namespace is another job, hence other runs.
        let other = run_events(&sample(), &ExportOptions { namespace: "cluster-2".into(), ..opts() });
        assert_ne!(other[0]["run"]["runId"], events[0]["run"]["runId"]);

        for e in &events {
            assert_eq!(e["schemaURL"], RUN_EVENT_SCHEMA_URL);
            assert_eq!(e["producer"], opts().producer);
            assert_eq!(e["job"], json!({"namespace": "strata", "name": "train-resnet"}));
            assert_eq!(e["outputs"], json!([]));
        }
    }

    #[test]
    fn event_times_follow_reads_and_marks() {
        let events = run_events(&sample(), &opts());
        let times: Vec<&str> = events.iter().map(|e| e["eventTime"].as_str().unwrap()).collect();
        assert_eq!(
            times,
            [
                "2026-12-05T16:20:00.050Z", // segment 0: its first read
                "2026-12-05T16:20:00.900Z", // its last read
                "2026-12-05T16:20:01.000Z", // segment 1: mark 1
                "2026-12-05T16:20:01.700Z",
                "2026-12-05T16:20:02.000Z", // segment 2: mark 2
                "2026-12-05T16:20:02.500Z",
            ]
        );
        let seg0 = &events[0]["run"]["facets"]["strata_mark"];
        assert_eq!(seg0["label"], Value::Null);
        assert_eq!(seg0["at"], Value::Null);
        assert_eq!(seg0["_schemaURL"], STRATA_MARK_SCHEMA_URL);
        let seg1 = &events[2]["run"]["facets"]["strata_mark"];
        assert_eq!(seg1["label"], "epoch-1");
        assert_eq!(seg1["at"], "2026-12-05T16:20:01.000Z");
    }

    #[test]
    fn unknown_mark_falls_back_to_reads_and_complete_never_precedes_start() {
        let mut job = sample();
        // A `since` query can leave out marks; a skewed mark can postdate the reads.
        job.marks = vec![mark(2, "late", T0 + 3_000)];
        let events = run_events(&job, &opts());
        assert_eq!(events[2]["eventTime"], "2026-12-05T16:20:01.100Z");
        assert_eq!(events[2]["run"]["facets"]["strata_mark"]["label"], Value::Null);
        assert_eq!(events[4]["eventTime"], "2026-12-05T16:20:03.000Z");
        assert_eq!(events[5]["eventTime"], "2026-12-05T16:20:03.000Z");
    }

    #[test]
    fn datasets_follow_the_naming_conventions() {
        let events = run_events(&sample(), &opts());

        // Segment 0: two readers of one S3 object version make one input.
        assert_eq!(events[0]["inputs"].as_array().unwrap().len(), 1);
        let a = input(&events[0], "s3://bucket", "prefix/a.bin");
        assert_eq!(a["facets"]["version"]["datasetVersion"], "\"etag-a1\"");
        assert_eq!(a["facets"]["version"]["_schemaURL"], DATASET_VERSION_SCHEMA_URL);
        let read = &a["inputFacets"]["strata_read"];
        assert_eq!(read["path"], "/data/a.bin");
        assert_eq!(read["bytes"], 2000);
        assert_eq!(read["reads"], 20);
        assert_eq!(read["firstRead"], "2026-12-05T16:20:00.050Z");
        assert_eq!(read["lastRead"], "2026-12-05T16:20:00.900Z");
        assert_eq!(a["inputFacets"]["inputStatistics"]["size"], 2000);
        assert_eq!(events[1]["inputs"], events[0]["inputs"], "COMPLETE carries the inputs too");

        // Segment 1: a local file and another version of the S3 object.
        let f = input(&events[2], "file", "/tmp/x/a.bin");
        assert_eq!(f["facets"]["version"]["datasetVersion"], "mtime-42");
        let a2 = input(&events[2], "s3://bucket", "prefix/a.bin");
        assert_eq!(a2["facets"]["version"]["datasetVersion"], "\"etag-a2\"");

        // Segment 2: HDFS keeps the absolute path; no UFS falls back to Strata's namespace.
        let b = input(&events[4], "hdfs://namenode:8020", "/warehouse/b.bin");
        assert_eq!(b["facets"]["version"]["datasetVersion"], "17");
        let c = input(&events[4], "strata", "/mem/c.bin");
        assert_eq!(c["facets"]["version"]["datasetVersion"], "v1");
    }

    #[test]
    fn dataset_ids_of_each_kind_of_uri() {
        let id = |ufs: &str| dataset_id(ufs, "/strata/p");
        let pair = |ns: &str, name: &str| (ns.to_string(), name.to_string());
        assert_eq!(id("s3://bucket/prefix/a.bin"), pair("s3://bucket", "prefix/a.bin"));
        assert_eq!(id("s3a://bucket/a.bin"), pair("s3://bucket", "a.bin"));
        assert_eq!(id("gcs://g/x/y"), pair("gs://g", "x/y"));
        assert_eq!(id("oss://o/k"), pair("oss://o", "k"));
        assert_eq!(id("azblob://container/k"), pair("azblob://container", "k"));
        assert_eq!(id("file:///tmp/x/a.bin"), pair("file", "/tmp/x/a.bin"));
        assert_eq!(id("file://localhost/tmp/a"), pair("file", "/tmp/a"));
        assert_eq!(id("file://nfs1/exports/a"), pair("file://nfs1", "/exports/a"));
        assert_eq!(
            id("hdfs://namenode:8020/warehouse/b.bin"),
            pair("hdfs://namenode:8020", "/warehouse/b.bin")
        );
        assert_eq!(id("webhdfs://nn:9870/w/c"), pair("webhdfs://nn:9870", "/w/c"));
        assert_eq!(id("S3://Bucket/K"), pair("s3://Bucket", "K"));
        assert_eq!(id("s3://bucket"), pair("s3://bucket", "/"));
        // Nothing usable: the file in Strata's namespace, never a panic.
        for bad in ["", "not a uri", "://x/y", "s3:///key", "1x://h/p", "file:"] {
            assert_eq!(id(bad), pair("strata", "/strata/p"), "{bad:?}");
        }
    }

    #[test]
    fn edge_cases_do_not_panic() {
        assert!(run_events(&LineageJobResponse::default(), &opts()).is_empty());
        let mut job = sample();
        job.job = String::new();
        job.records[0].first_read_ms = i64::MIN;
        job.records[0].version = String::new();
        let events = run_events(&job, &opts());
        assert_eq!(events[0]["job"]["name"], "anonymous");
        let b = input(&events[4], "hdfs://namenode:8020", "/warehouse/b.bin");
        assert_eq!(b["facets"], json!({}), "no version facet for an empty version");
        assert_eq!(b["inputFacets"]["strata_read"]["firstRead"], "1970-01-01T00:00:00.000Z");
    }

    #[test]
    fn run_ids_are_standard_uuid_v5() {
        // The namespace is what its comment says, and the ids are what Python's uuid5 gives.
        let namespace = uuid::Uuid::new_v5(
            &uuid::Uuid::NAMESPACE_URL,
            b"https://github.com/strata-cache/strata/blob/main/docs/openlineage/README.md#run-ids",
        );
        assert_eq!(namespace.as_bytes(), &RUN_ID_NAMESPACE);
        assert_eq!(run_id("strata", "train-resnet", 0), "a064dc04-6faa-5c8f-a5d6-407d02aba747");
        assert_eq!(run_id("strata", "train-resnet", 1), "6206ab73-3ee8-598f-9e75-0eeb43f0dc2b");
    }

    /// A minimal HTTP/1.1 server: sends each request's body to the test and answers 200, or
    /// `fail_status` to the request numbered `fail_at` (0-based), or nothing at all when
    /// `fail_status` is 0 (a hung server).
    async fn lineage_server(
        fail_at: usize,
        fail_status: u16,
    ) -> (String, mpsc::UnboundedReceiver<(String, String)>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/api/v1/lineage", listener.local_addr().unwrap());
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut served = 0;
            loop {
                let Ok((socket, _)) = listener.accept().await else { return };
                let (read, mut write) = socket.into_split();
                let mut read = BufReader::new(read);
                // One connection may carry several requests (keep-alive).
                loop {
                    let mut request_line = String::new();
                    if read.read_line(&mut request_line).await.unwrap_or(0) == 0 {
                        break;
                    }
                    let (mut length, mut content_type) = (0usize, String::new());
                    loop {
                        let mut line = String::new();
                        read.read_line(&mut line).await.unwrap();
                        let line = line.trim_end();
                        if line.is_empty() {
                            break;
                        }
                        let (name, value) = line.split_once(':').unwrap();
                        match name.to_ascii_lowercase().as_str() {
                            "content-length" => length = value.trim().parse().unwrap(),
                            "content-type" => content_type = value.trim().to_string(),
                            _ => {}
                        }
                    }
                    let mut body = vec![0; length];
                    read.read_exact(&mut body).await.unwrap();
                    assert!(request_line.starts_with("POST /api/v1/lineage "), "{request_line}");
                    tx.send((content_type, String::from_utf8(body).unwrap())).unwrap();
                    let answer = if served == fail_at && fail_status == 0 {
                        std::future::pending::<String>().await
                    } else if served == fail_at {
                        let body = r#"{"error":"boom"}"#;
                        format!("HTTP/1.1 {fail_status} Oops\r\ncontent-length: {}\r\n\r\n{body}", body.len())
                    } else {
                        "HTTP/1.1 201 Created\r\ncontent-length: 0\r\n\r\n".to_string()
                    };
                    served += 1;
                    write.write_all(answer.as_bytes()).await.unwrap();
                }
            }
        });
        (url, rx)
    }

    fn received(rx: &mut mpsc::UnboundedReceiver<(String, String)>) -> Vec<Value> {
        let mut bodies = Vec::new();
        while let Ok((content_type, body)) = rx.try_recv() {
            assert_eq!(content_type, "application/json");
            bodies.push(serde_json::from_str(&body).unwrap());
        }
        bodies
    }

    #[tokio::test]
    async fn posts_every_event_in_order() {
        let events = run_events(&sample(), &opts());
        let (url, mut rx) = lineage_server(usize::MAX, 500).await;
        let sent = post_events(&url, &events, Duration::from_secs(10)).await.unwrap();
        assert_eq!(sent, 6);
        assert_eq!(received(&mut rx), events);
    }

    #[tokio::test]
    async fn an_error_answer_names_the_event_and_status() {
        let events = run_events(&sample(), &opts());
        let (url, mut rx) = lineage_server(2, 500).await;
        let err = format!("{:#}", post_events(&url, &events, Duration::from_secs(10)).await.unwrap_err());
        assert!(err.contains("event 2 (0-based) of 6"), "{err}");
        assert!(err.contains("500"), "{err}");
        assert!(err.contains("boom"), "{err}");
        assert_eq!(received(&mut rx).len(), 3, "nothing is sent after the failure");
    }

    #[tokio::test]
    async fn a_hung_server_times_out_with_the_event_named() {
        let events = run_events(&sample(), &opts());
        let (url, _rx) = lineage_server(1, 0).await;
        let err = format!("{:#}", post_events(&url, &events, Duration::from_millis(300)).await.unwrap_err());
        assert!(err.contains("event 1 (0-based) of 6"), "{err}");
        assert!(err.contains("no answer"), "{err}");
    }

    #[tokio::test]
    async fn bad_urls_are_refused_before_sending() {
        let events = run_events(&sample(), &opts());
        for url in ["", "localhost:5000/api/v1/lineage", "ftp://host/x"] {
            assert!(post_events(url, &events, Duration::from_secs(1)).await.is_err(), "{url}");
        }
    }
}
