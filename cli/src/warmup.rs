//! `strata warmup` and `strata job ...`: load jobs and schedules on the master, a progress bar
//! while following one, JSON for scripts. The exit code is 0 only for a job that SUCCEEDED.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{Value, json};
use strata_client::{Client, JobInfo, JobState, LoadOptions, ScheduleInfo};
use strata_common::units::parse_size;

/// What to load and how (shared by `warmup` and `job schedule`).
#[derive(Args, Debug, Clone)]
pub struct LoadArgs {
    /// Distinct workers to load each block on (the first N owners on the ring).
    #[arg(long, default_value_t = 1)]
    pub replicas: u32,
    /// Per-worker cap on load traffic, bytes per second (e.g. 200MiB).
    #[arg(long, value_name = "BYTES/s")]
    pub bandwidth: Option<String>,
    /// Block loads in flight per worker (default 16; fewer while clients read).
    #[arg(long)]
    pub parallelism: Option<u32>,
    /// Only files matching this glob (repeatable). Without `/` it matches the file name at any
    /// depth; with `/` the path under PATH (`**` spans directories).
    #[arg(long, value_name = "GLOB")]
    pub include: Vec<String>,
    /// Skip files matching this glob (repeatable; same rules as --include).
    #[arg(long, value_name = "GLOB")]
    pub exclude: Vec<String>,
    /// Skip blocks the master already knows to be cached on their workers.
    #[arg(long)]
    pub skip_cached: bool,
    /// After loading, check every block is cached and load what is missing or new.
    #[arg(long)]
    pub verify: bool,
    /// Refresh the metadata of every file from the UFS first.
    #[arg(long)]
    pub sync: bool,
    /// Only count what would be loaded (files, bytes).
    #[arg(long)]
    pub dry_run: bool,
    /// Only refresh metadata; load no data.
    #[arg(long)]
    pub metadata_only: bool,
}

impl LoadArgs {
    fn options(&self) -> Result<LoadOptions> {
        let bandwidth = match &self.bandwidth {
            None => 0,
            Some(b) => parse_size(b.trim_end_matches("/s"))
                .with_context(|| format!("--bandwidth {b:?}: expected bytes per second such as 100MiB"))?,
        };
        if self.replicas == 0 {
            bail!("--replicas must be at least 1");
        }
        Ok(LoadOptions {
            replicas: self.replicas,
            bandwidth,
            parallelism: self.parallelism.unwrap_or(0),
            include: self.include.clone(),
            exclude: self.exclude.clone(),
            skip_cached: self.skip_cached,
            verify: self.verify,
            sync: self.sync,
            dry_run: self.dry_run,
            metadata_only: self.metadata_only,
        })
    }
}

#[derive(Args, Debug)]
pub struct WarmupArgs {
    /// A file or directory under a mount, e.g. /datasets/train.
    pub path: String,
    #[command(flatten)]
    pub load: LoadArgs,
    /// Print the job id and return at once instead of following the job.
    #[arg(long)]
    pub detach: bool,
    /// Print JSON (the job's final state, or its id with --detach) instead of a progress bar.
    #[arg(long)]
    pub json: bool,
}

#[derive(Subcommand, Debug)]
pub enum JobCommand {
    /// Running load jobs.
    Ls {
        #[arg(long)]
        json: bool,
    },
    /// One job's state and progress (exit code 0 only if it SUCCEEDED).
    Status {
        id: String,
        #[arg(long)]
        json: bool,
    },
    /// Stop a running job.
    Cancel { id: String },
    /// Every job the master remembers, newest first.
    History {
        #[arg(long, default_value_t = 20)]
        limit: u32,
        #[arg(long)]
        json: bool,
    },
    /// Store a schedule that submits a load job of PATH at each time of a cron expression.
    Schedule {
        /// 5 fields (minute hour day month weekday), or 6 with leading seconds.
        #[arg(long)]
        cron: String,
        /// IANA time zone the expression is read in (default UTC), e.g. Europe/Paris.
        #[arg(long, default_value = "")]
        tz: String,
        path: String,
        #[command(flatten)]
        load: LoadArgs,
        #[arg(long)]
        json: bool,
    },
    /// Remove a schedule (a job it started runs on).
    Unschedule { id: String },
    /// Stored schedules with their next time.
    Schedules {
        #[arg(long)]
        json: bool,
    },
}

fn state_name(job: &JobInfo) -> &'static str {
    match job.state() {
        JobState::Running => "RUNNING",
        JobState::Succeeded => "SUCCEEDED",
        JobState::Failed => "FAILED",
        JobState::Cancelled => "CANCELLED",
        JobState::Unspecified => "UNKNOWN",
    }
}

fn job_json(job: &JobInfo) -> Value {
    let o = job.options.clone().unwrap_or_default();
    json!({
        "id": job.id, "path": job.path, "state": state_name(job), "pass": job.pass,
        "listing_done": job.listing_done,
        "files_total": job.files_total, "files_done": job.files_done, "files_failed": job.files_failed,
        "bytes_total": job.bytes_total, "bytes_done": job.bytes_done,
        "blocks_total": job.blocks_total, "blocks_done": job.blocks_done,
        "blocks_already_cached": job.blocks_already_cached, "blocks_verify_loaded": job.blocks_verify_loaded,
        "task_retries": job.task_retries, "resumed": job.resumed,
        "created_ms": job.created_ms, "finished_ms": job.finished_ms, "schedule_id": job.schedule_id,
        "failures": job.failures.iter().map(|f| json!({"path": f.path, "reason": f.reason})).collect::<Vec<_>>(),
        "options": {
            "replicas": o.replicas, "bandwidth": o.bandwidth, "parallelism": o.parallelism,
            "include": o.include, "exclude": o.exclude, "skip_cached": o.skip_cached, "verify": o.verify,
            "sync": o.sync, "dry_run": o.dry_run, "metadata_only": o.metadata_only,
        },
    })
}

fn schedule_json(s: &ScheduleInfo) -> Value {
    json!({
        "id": s.id, "cron": s.cron, "tz": s.tz, "path": s.path, "next_fire_ms": s.next_fire_ms,
        "last_job_id": s.last_job_id, "fired": s.fired, "skipped": s.skipped, "created_ms": s.created_ms,
    })
}

fn summary_line(job: &JobInfo) -> String {
    format!(
        "{}  {:<9}  {}  files {}/{}  bytes {}/{}  failed {}",
        job.id,
        state_name(job),
        job.path,
        job.files_done,
        job.files_total,
        job.bytes_done,
        job.bytes_total,
        job.files_failed
    )
}

/// Ok for a SUCCEEDED job; otherwise an error naming the failed files (the exit code is 1).
fn outcome(job: &JobInfo) -> Result<()> {
    if job.state() == JobState::Succeeded {
        return Ok(());
    }
    let mut msg = format!("job {} ended {}", job.id, state_name(job));
    if job.state() == JobState::Running {
        msg = format!("job {} is still RUNNING", job.id);
    }
    for f in job.failures.iter().take(20) {
        msg.push_str(&format!("\n  {}: {}", f.path, f.reason));
    }
    if job.files_failed as usize > job.failures.len().min(20) {
        msg.push_str(&format!(
            "\n  ... {} failed files in all (strata job status {} --json)",
            job.files_failed, job.id
        ));
    }
    bail!(msg)
}

pub async fn warmup(client: &Client, args: WarmupArgs) -> Result<()> {
    let job = client.admin().submit_load(&args.path, args.load.options()?).await?;
    if args.detach {
        if args.json {
            outln!("{}", json!({"id": job.id}))?;
        } else {
            outln!("{}", job.id)?;
        }
        return Ok(());
    }
    let done = if args.json {
        client.admin().wait_job(&job.id, Duration::from_millis(500), |_| {}).await?
    } else {
        follow(client, &job.id).await?
    };
    if args.json {
        outln!("{}", serde_json::to_string_pretty(&job_json(&done))?)?;
    } else {
        outln!("{}", summary_line(&done))?;
    }
    outcome(&done)
}

/// Follows a job with a progress bar on stderr: bytes, throughput, ETA, files and failures.
async fn follow(client: &Client, id: &str) -> Result<JobInfo> {
    let bar = ProgressBar::new(0);
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}",
    )
    .context("progress bar template")?;
    bar.set_style(style);
    bar.enable_steady_tick(Duration::from_millis(200));
    let started = Instant::now();
    let done = client
        .admin()
        .wait_job(id, Duration::from_millis(300), |job| {
            bar.set_length(job.bytes_total.max(1));
            bar.set_position(job.bytes_done);
            let listing = if job.listing_done { "" } else { " (listing)" };
            let pass = if job.pass == 2 { " verify" } else { "" };
            bar.set_message(format!(
                "files {}/{}{listing}{pass} failed {}",
                job.files_done, job.files_total, job.files_failed
            ));
        })
        .await?;
    bar.finish_and_clear();
    let secs = started.elapsed().as_secs_f64().max(0.001);
    eprintln!(
        "{} in {:.1} s: {} files, {} bytes ({:.1} MB/s), {} blocks already cached",
        state_name(&done),
        secs,
        done.files_done,
        done.bytes_done,
        done.bytes_done as f64 / secs / 1e6,
        done.blocks_already_cached
    );
    Ok(done)
}

pub async fn job(client: &Client, cmd: JobCommand) -> Result<()> {
    match cmd {
        JobCommand::Ls { json } => print_jobs(&client.admin().list_jobs(false, 0).await?, json),
        JobCommand::History { limit, json } => {
            print_jobs(&client.admin().list_jobs(true, limit).await?, json)
        }
        JobCommand::Status { id, json } => {
            let job = client.admin().job_status(&id).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&job_json(&job))?)?;
            } else {
                outln!("{}", summary_line(&job))?;
                outln!(
                    "  pass {}  blocks {}/{} (already cached {}, verify loaded {})  retries {}  resumed {}",
                    job.pass,
                    job.blocks_done,
                    job.blocks_total,
                    job.blocks_already_cached,
                    job.blocks_verify_loaded,
                    job.task_retries,
                    job.resumed
                )?;
            }
            outcome(&job)
        }
        JobCommand::Cancel { id } => {
            let job = client.admin().cancel_job(&id).await?;
            outln!("{}", summary_line(&job))?;
            Ok(())
        }
        JobCommand::Schedule { cron, tz, path, load, json } => {
            let s = client.admin().add_schedule(&cron, &tz, &path, load.options()?).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&schedule_json(&s))?)?;
            } else {
                outln!("{}  {} ({})  {}  next at {} ms", s.id, s.cron, s.tz, s.path, s.next_fire_ms)?;
            }
            Ok(())
        }
        JobCommand::Unschedule { id } => {
            client.admin().remove_schedule(&id).await?;
            outln!("removed schedule {id}")?;
            Ok(())
        }
        JobCommand::Schedules { json } => {
            let all = client.admin().list_schedules().await?;
            if json {
                let v: Vec<Value> = all.iter().map(schedule_json).collect();
                outln!("{}", serde_json::to_string_pretty(&v)?)?;
            } else {
                for s in &all {
                    outln!(
                        "{}  {} ({})  {}  next {} ms  fired {}  skipped {}  last job {}",
                        s.id,
                        s.cron,
                        s.tz,
                        s.path,
                        s.next_fire_ms,
                        s.fired,
                        s.skipped,
                        s.last_job_id
                    )?;
                }
            }
            Ok(())
        }
    }
}

fn print_jobs(jobs: &[JobInfo], json: bool) -> Result<()> {
    if json {
        let v: Vec<Value> = jobs.iter().map(job_json).collect();
        outln!("{}", serde_json::to_string_pretty(&v)?)?;
    } else {
        for j in jobs {
            outln!("{}", summary_line(j))?;
        }
    }
    Ok(())
}
