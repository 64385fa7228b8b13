//! Warmup schedules: a cron expression (5 fields, or 6 with leading seconds) in a time zone,
//! and the load job it submits at each of its times. Sans-IO: `due(now_ms)` is driven by the
//! master's jobs tick with its clock's wall time, and by tests with any clock they like.
//!
//! Policies:
//! - **missed times run once**: a schedule whose time passed while the master was down fires
//!   once at the first tick after start, however many times it missed, then follows its cron
//!   from then on;
//! - **never two copies**: a time that comes while the schedule's previous job is still
//!   running is skipped (and counted), not queued.

use std::collections::BTreeMap;
use std::str::FromStr;

use chrono::{TimeZone, Utc};
use croner::Cron;
use croner::parser::{CronParser, Seconds};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::jobs::LoadSettings;

/// Why a schedule is refused; each message is fit for the user.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ScheduleError {
    #[error("bad cron expression {cron:?}: {reason} (expected 5 fields, or 6 with leading seconds)")]
    BadCron { cron: String, reason: String },
    #[error("unknown time zone {0:?} (expected an IANA name such as Europe/Paris)")]
    UnknownZone(String),
    #[error("cron {0:?} never fires")]
    NeverFires(String),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScheduleRecord {
    pub id: String,
    pub cron: String,
    /// IANA zone name; "UTC" by default.
    pub tz: String,
    pub path: String,
    pub settings: LoadSettings,
    pub next_fire_ms: i64,
    pub last_job_id: String,
    pub fired: u64,
    pub skipped: u64,
    pub created_ms: i64,
}

/// A schedule whose time has come: submit a job of `path` with `settings` for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fire {
    pub schedule_id: String,
    pub path: String,
    pub settings: LoadSettings,
}

struct Entry {
    record: ScheduleRecord,
    cron: Cron,
    tz: chrono_tz::Tz,
}

#[derive(Default)]
pub struct Schedules {
    entries: BTreeMap<String, Entry>,
}

/// Parses a cron expression and a zone (empty means UTC).
pub fn parse(cron: &str, tz: &str) -> Result<(Cron, chrono_tz::Tz), ScheduleError> {
    let parsed = CronParser::builder()
        .seconds(Seconds::Optional)
        .build()
        .parse(cron)
        .map_err(|e| ScheduleError::BadCron { cron: cron.to_string(), reason: e.to_string() })?;
    let zone = if tz.is_empty() { "UTC" } else { tz };
    let tz = chrono_tz::Tz::from_str(zone).map_err(|_| ScheduleError::UnknownZone(zone.to_string()))?;
    Ok((parsed, tz))
}

/// The first time of `cron` in `tz` strictly after `after_ms`, in ms since the epoch.
pub fn next_after(cron: &Cron, tz: chrono_tz::Tz, after_ms: i64) -> Option<i64> {
    let after = Utc.timestamp_millis_opt(after_ms).single()?.with_timezone(&tz);
    cron.find_next_occurrence(&after, false).ok().map(|t| t.timestamp_millis())
}

impl Schedules {
    /// Adds a schedule (new, or loaded from the store). A new one gets its first time after
    /// `now_ms`; a loaded one keeps its stored time, even if that is past (missed).
    pub fn insert(
        &mut self,
        mut record: ScheduleRecord,
        now_ms: i64,
    ) -> Result<&ScheduleRecord, ScheduleError> {
        let (cron, tz) = parse(&record.cron, &record.tz)?;
        if record.next_fire_ms == 0 {
            record.next_fire_ms = next_after(&cron, tz, now_ms)
                .ok_or_else(|| ScheduleError::NeverFires(record.cron.clone()))?;
        }
        let id = record.id.clone();
        self.entries.insert(id.clone(), Entry { record, cron, tz });
        Ok(&self.entries[&id].record)
    }

    pub fn remove(&mut self, id: &str) -> bool {
        self.entries.remove(id).is_some()
    }

    pub fn records(&self) -> impl Iterator<Item = &ScheduleRecord> {
        self.entries.values().map(|e| &e.record)
    }

    pub fn get(&self, id: &str) -> Option<&ScheduleRecord> {
        self.entries.get(id).map(|e| &e.record)
    }

    /// Schedules due at `now_ms`. `running(job_id)` tells whether a schedule's last job is
    /// still running. Each due schedule moves to its next time after `now_ms`; the changed
    /// records are returned to be stored, along with what to fire.
    pub fn due(&mut self, now_ms: i64, running: impl Fn(&str) -> bool) -> (Vec<Fire>, Vec<ScheduleRecord>) {
        let mut fires = Vec::new();
        let mut changed = Vec::new();
        for e in self.entries.values_mut() {
            if e.record.next_fire_ms > now_ms {
                continue;
            }
            if !e.record.last_job_id.is_empty() && running(&e.record.last_job_id) {
                e.record.skipped += 1;
            } else {
                e.record.fired += 1;
                fires.push(Fire {
                    schedule_id: e.record.id.clone(),
                    path: e.record.path.clone(),
                    settings: e.record.settings.clone(),
                });
            }
            // Missed times collapse into this one run.
            e.record.next_fire_ms = next_after(&e.cron, e.tz, now_ms).unwrap_or(i64::MAX);
            changed.push(e.record.clone());
        }
        (fires, changed)
    }

    /// Records the job a fire submitted, so the next time knows whether it still runs.
    pub fn set_last_job(&mut self, id: &str, job_id: &str) -> Option<ScheduleRecord> {
        let e = self.entries.get_mut(id)?;
        e.record.last_job_id = job_id.to_string();
        Some(e.record.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(cron: &str, tz: &str) -> ScheduleRecord {
        ScheduleRecord {
            id: "s1".into(),
            cron: cron.into(),
            tz: tz.into(),
            path: "/data".into(),
            settings: LoadSettings::default(),
            next_fire_ms: 0,
            last_job_id: String::new(),
            fired: 0,
            skipped: 0,
            created_ms: 0,
        }
    }

    #[test]
    fn bad_cron_and_zone_are_refused_with_a_reason() {
        let e = parse("61 * * * *", "").unwrap_err();
        assert!(matches!(e, ScheduleError::BadCron { .. }), "{e:?}");
        assert!(e.to_string().contains("bad cron expression"), "{e}");
        let e = parse("0 1 * * *", "Mars/Olympus").unwrap_err();
        assert_eq!(e, ScheduleError::UnknownZone("Mars/Olympus".into()));
        assert!(e.to_string().contains("unknown time zone"), "{e}");
        assert!(parse("*/2 * * * * *", "Europe/Paris").is_ok());
    }

    #[test]
    fn fires_at_each_time_and_never_twice_concurrently() {
        let mut s = Schedules::default();
        let t0 = 1_700_000_000_000; // a whole second
        s.insert(record("*/2 * * * * *", ""), t0).unwrap();
        assert_eq!(s.get("s1").unwrap().next_fire_ms, t0 + 2000);
        let mut fired = 0;
        let mut running_job: Option<String> = None;
        // 20 s of 100 ms ticks; each job runs 3 s, so every other time finds it running.
        let mut job_ends = 0;
        for tick in 0..=200 {
            let now = t0 + tick * 100;
            if running_job.is_some() && now >= job_ends {
                running_job = None;
            }
            let (fires, _) = s.due(now, |id| running_job.as_deref() == Some(id));
            for f in fires {
                assert!(running_job.is_none(), "a second copy while one runs");
                fired += 1;
                let id = format!("job-{fired}");
                s.set_last_job(&f.schedule_id, &id);
                running_job = Some(id);
                job_ends = now + 3000;
            }
        }
        let r = s.get("s1").unwrap();
        assert_eq!(r.fired, fired);
        // Times at 2,4,...,20 s: 10 of them; fired at 2,6,10,14,18 and skipped the rest.
        assert_eq!((fired, r.skipped), (5, 5));
    }

    #[test]
    fn missed_times_run_once_after_a_restart() {
        let mut s = Schedules::default();
        let t0 = 1_700_000_000_000;
        let first = s.insert(record("0 * * * *", ""), t0).unwrap().clone();
        // The master was down for five hours: the stored schedule comes back with a past time.
        let mut restarted = Schedules::default();
        let later = first.next_fire_ms + 5 * 3_600_000 + 60_000;
        restarted.insert(first.clone(), later).unwrap();
        let (fires, changed) = restarted.due(later, |_| false);
        assert_eq!(fires.len(), 1, "five missed hours run once");
        assert!(changed[0].next_fire_ms > later);
        assert!(restarted.due(later + 1000, |_| false).0.is_empty());
    }

    #[test]
    fn times_follow_the_zone() {
        let (cron, tz) = parse("0 1 * * *", "Europe/Paris").unwrap();
        // 01:00 in Paris in January (UTC+1) is 00:00 UTC.
        let t = Utc.with_ymd_and_hms(2024, 1, 14, 23, 30, 0).unwrap().timestamp_millis();
        let next = next_after(&cron, tz, t).unwrap();
        assert_eq!(next, Utc.with_ymd_and_hms(2024, 1, 15, 0, 0, 0).unwrap().timestamp_millis());
    }
}
