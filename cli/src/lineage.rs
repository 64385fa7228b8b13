//! `strata lineage`: which jobs read which file versions (docs/LINEAGE.md).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Subcommand;
use serde_json::{Value, json};
use strata_client::Client;
use strata_proto::{LineageJobResponse, LineageMark, LineageRecord};

#[derive(Subcommand)]
pub enum LineageCommand {
    /// The files job NAME read, each with the exact version it read, its bytes, reads, and
    /// first and last read, under the marks the job made. --json prints
    /// {job, since, marks: [...], files: [{path, version, ufs, bytes, reads, first_read,
    /// last_read, marks: [seq...]}], records: [...]} (see docs/LINEAGE.md).
    Job {
        name: String,
        /// Only the reads from the last mark with this label on (`#N`: mark number N).
        #[arg(long, value_name = "MARK")]
        since: Option<String>,
        #[arg(long)]
        json: bool,
    },
    /// Which jobs read PATH, in which version, and when.
    File {
        path: String,
        #[arg(long)]
        json: bool,
    },
    /// Jobs with recorded reads: files, bytes, first and last read, marks.
    Jobs {
        #[arg(long)]
        json: bool,
    },
    /// Mark a point in the run of the job named by --job (or STRATA_JOB), e.g. `strata --job
    /// train-42 lineage mark "epoch=3 step=12000"`: its reads after it are grouped under LABEL.
    Mark { label: String },
    /// Write job NAME's lineage as OpenLineage run events (one run per segment between marks,
    /// a START and a COMPLETE event each, the file versions read as input datasets): JSON
    /// Lines to --output (default standard output), or POSTed one by one to --url (Marquez:
    /// http://HOST:5000/api/v1/lineage).
    Export {
        name: String,
        #[arg(long, value_name = "MARK")]
        since: Option<String>,
        /// The OpenLineage job namespace.
        #[arg(long, default_value = "strata")]
        namespace: String,
        /// File to write the events to (JSON Lines); `-` or unset: standard output.
        #[arg(long, value_name = "FILE", conflicts_with = "url")]
        output: Option<PathBuf>,
        /// HTTP endpoint to POST each event to.
        #[arg(long, value_name = "URL")]
        url: Option<String>,
        /// With --url: how long one POST may take, e.g. 10s.
        #[arg(long, default_value = "10s")]
        timeout: String,
    },
}

pub async fn run(client: &Client, job: Option<&str>, cmd: LineageCommand) -> Result<()> {
    match cmd {
        LineageCommand::Job { name, since, json } => {
            let since = since.unwrap_or_default();
            let found = client.lineage_job(&name, &since).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&job_json(&found, &since))?)?;
            } else {
                print_job(&found, &since)?;
            }
        }
        LineageCommand::File { path, json } => {
            let records = client.lineage_file(&path).await?;
            if json {
                let v: Vec<Value> = records.iter().map(record_json).collect();
                outln!("{}", serde_json::to_string_pretty(&json!({"path": path, "reads": v}))?)?;
            } else if records.is_empty() {
                outln!("no job's reads of {path} are recorded")?;
            } else {
                outln!("JOB\tMARK\tVERSION\tBYTES\tREADS\tFIRST READ\tLAST READ")?;
                for r in records {
                    outln!(
                        "{}\t{}\t{}\t{}\t{}\t{}\t{}",
                        r.job,
                        r.mark_seq,
                        r.version,
                        r.bytes,
                        r.reads,
                        time(r.first_read_ms),
                        time(r.last_read_ms)
                    )?;
                }
            }
        }
        LineageCommand::Jobs { json } => {
            let jobs = client.lineage_jobs().await?;
            if json {
                let v: Vec<Value> = jobs
                    .iter()
                    .map(|j| json!({"job": j.job, "files": j.files, "bytes": j.bytes, "marks": j.marks,
                        "first_read": time_or_null(j.first_read_ms), "last_read": time_or_null(j.last_read_ms)}))
                    .collect();
                outln!("{}", serde_json::to_string_pretty(&v)?)?;
            } else {
                outln!("JOB\tFILES\tBYTES\tMARKS\tFIRST READ\tLAST READ")?;
                for j in jobs {
                    outln!(
                        "{}\t{}\t{}\t{}\t{}\t{}",
                        j.job,
                        j.files,
                        j.bytes,
                        j.marks,
                        time(j.first_read_ms),
                        time(j.last_read_ms)
                    )?;
                }
            }
        }
        LineageCommand::Mark { label } => {
            let Some(job) = job else {
                bail!("name the job to mark with --job NAME or STRATA_JOB=NAME");
            };
            let mark = client.lineage_mark_for(job, &label).await?;
            outln!("marked {} #{}: {:?} at {}", mark.job, mark.seq, mark.label, time(mark.at_ms))?;
        }
        LineageCommand::Export { name, since, namespace, output, url, timeout } => {
            let found = client.lineage_job(&name, since.as_deref().unwrap_or_default()).await?;
            let options = crate::openlineage::ExportOptions {
                namespace,
                producer: format!(
                    "https://github.com/strata-cache/strata/tree/v{}",
                    env!("CARGO_PKG_VERSION")
                ),
            };
            let events = crate::openlineage::run_events(&found, &options);
            match (url, output) {
                (Some(url), _) => {
                    let timeout = strata_common::units::parse_duration(&timeout)
                        .with_context(|| format!("--timeout {timeout:?}: expected a duration such as 10s"))?;
                    let sent = crate::openlineage::post_events(&url, &events, timeout).await?;
                    eprintln!("sent {sent} OpenLineage events to {url}");
                }
                (None, Some(path)) if path.as_os_str() != "-" => {
                    let mut file = std::io::BufWriter::new(
                        std::fs::File::create(&path)
                            .with_context(|| format!("creating {}", path.display()))?,
                    );
                    for e in &events {
                        writeln!(file, "{e}")?;
                    }
                    file.flush()?;
                    eprintln!("wrote {} OpenLineage events to {}", events.len(), path.display());
                }
                _ => {
                    for e in &events {
                        outln!("{e}")?;
                    }
                }
            }
        }
    }
    Ok(())
}

fn time(ms: i64) -> String {
    chrono::DateTime::from_timestamp_millis(ms)
        .map_or_else(|| ms.to_string(), |t| t.format("%Y-%m-%dT%H:%M:%S%.3fZ").to_string())
}

fn time_or_null(ms: i64) -> Value {
    if ms == 0 { Value::Null } else { Value::String(time(ms)) }
}

fn mark_json(m: &LineageMark) -> Value {
    json!({"seq": m.seq, "label": m.label, "at": time(m.at_ms), "at_ms": m.at_ms})
}

fn record_json(r: &LineageRecord) -> Value {
    json!({"job": r.job, "path": r.path, "version": r.version, "ufs": r.ufs, "bytes": r.bytes,
        "reads": r.reads, "first_read": time(r.first_read_ms), "last_read": time(r.last_read_ms),
        "first_read_ms": r.first_read_ms, "last_read_ms": r.last_read_ms, "mark": r.mark_seq,
        "reader": r.reader})
}

/// One file version a job read, summed over marks and readers.
#[derive(Default)]
struct FileRead {
    ufs: String,
    bytes: u64,
    reads: u64,
    first: i64,
    last: i64,
    marks: Vec<u64>,
}

fn files_of(records: &[LineageRecord]) -> BTreeMap<(&str, &str), FileRead> {
    let mut files: BTreeMap<(&str, &str), FileRead> = BTreeMap::new();
    for r in records {
        let f = files.entry((&r.path, &r.version)).or_default();
        if f.reads == 0 {
            f.first = r.first_read_ms;
        }
        f.ufs.clone_from(&r.ufs);
        f.bytes += r.bytes;
        f.reads += r.reads;
        f.first = f.first.min(r.first_read_ms);
        f.last = f.last.max(r.last_read_ms);
        if !f.marks.contains(&r.mark_seq) {
            f.marks.push(r.mark_seq);
        }
    }
    files
}

fn job_json(found: &LineageJobResponse, since: &str) -> Value {
    let files: Vec<Value> = files_of(&found.records)
        .into_iter()
        .map(|((path, version), f)| {
            json!({"path": path, "version": version, "ufs": f.ufs, "bytes": f.bytes, "reads": f.reads,
                "first_read": time(f.first), "last_read": time(f.last), "marks": f.marks})
        })
        .collect();
    json!({
        "job": found.job,
        "since": if since.is_empty() { Value::Null } else { Value::String(since.to_string()) },
        "marks": found.marks.iter().map(mark_json).collect::<Vec<_>>(),
        "files": files,
        "records": found.records.iter().map(record_json).collect::<Vec<_>>(),
    })
}

fn print_job(found: &LineageJobResponse, since: &str) -> Result<()> {
    let files = files_of(&found.records);
    let bytes: u64 = found.records.iter().map(|r| r.bytes).sum();
    let from = if since.is_empty() { String::new() } else { format!(" since mark {since}") };
    outln!(
        "job {}{from}: {} file versions, {} bytes, {} marks",
        found.job,
        files.len(),
        bytes,
        found.marks.len()
    )?;
    let label = |seq: u64| {
        found
            .marks
            .iter()
            .find(|m| m.seq == seq)
            .map_or_else(|| "-".to_string(), |m| format!("#{} {}", m.seq, m.label))
    };
    outln!("MARK\tPATH\tVERSION\tBYTES\tREADS\tFIRST READ\tLAST READ")?;
    for r in &found.records {
        outln!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}",
            label(r.mark_seq),
            r.path,
            r.version,
            r.bytes,
            r.reads,
            time(r.first_read_ms),
            time(r.last_read_ms)
        )?;
    }
    Ok(())
}
