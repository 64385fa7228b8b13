//! Durable master state. Mounts, jobs and schedules live in an embedded redb file, one table
//! each, as JSON records keyed by path or id, so a master restart loses nothing; workers
//! re-register and re-report the rest. A record that no longer parses is reported as `Corrupt`
//! with its key, never skipped silently.
//!
//! [`MetaStore`] is the seam, kept synchronous: a call blocks its caller for one local
//! transaction (redb) or one etcd round trip, bounded by a timeout (`etcd`, for several masters
//! with a leader; see that module for the election and the fencing of writes).

use std::path::Path;
use std::sync::Mutex;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use strata_security::token::TokenRecord;
use thiserror::Error;

use crate::jobs::JobRecord;
use crate::lineage::{LineageRecord, MarkRecord};
use crate::membership::WorkerEntry;
use crate::mounts::MountRecord;
use crate::pins::{CacheTtlRecord, PinRecord};
use crate::schedule::ScheduleRecord;
use crate::writeback::PendingRecord;

pub mod etcd;

const MOUNTS: TableDefinition<&str, &str> = TableDefinition::new("mounts");
const JOBS: TableDefinition<&str, &str> = TableDefinition::new("jobs");
const SCHEDULES: TableDefinition<&str, &str> = TableDefinition::new("schedules");
const TOKENS: TableDefinition<&str, &str> = TableDefinition::new("tokens");
const PENDING: TableDefinition<&str, &str> = TableDefinition::new("writeback");
const PINS: TableDefinition<&str, &str> = TableDefinition::new("pins");
const CACHE_TTLS: TableDefinition<&str, &str> = TableDefinition::new("cache_ttls");
const LINEAGE: TableDefinition<&str, &str> = TableDefinition::new("lineage");
const LINEAGE_MARKS: TableDefinition<&str, &str> = TableDefinition::new("lineage_marks");

#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StoreError {
    #[error("metadata store: {0}")]
    Db(String),
    #[error("metadata store holds a malformed record under {key}: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("metadata store is closed")]
    Closed,
    /// This master does not lead (any more): the write was refused, by etcd or before it.
    #[error("not the leader: this master's term ended")]
    NotLeader,
    /// etcd refused, failed or did not answer in time.
    #[error("metadata store: {0}")]
    Etcd(String),
    #[error("metadata store configuration: {0}")]
    Config(String),
}

fn db_err(e: impl std::fmt::Display) -> StoreError {
    StoreError::Db(e.to_string())
}

pub trait MetaStore: Send + Sync + 'static {
    fn load_mounts(&self) -> Result<Vec<MountRecord>, StoreError>;
    fn put_mount(&self, record: &MountRecord) -> Result<(), StoreError>;
    fn delete_mount(&self, path: &str) -> Result<(), StoreError>;
    /// Every job, running or finished (the history).
    fn load_jobs(&self) -> Result<Vec<JobRecord>, StoreError>;
    fn put_job(&self, record: &JobRecord) -> Result<(), StoreError>;
    fn delete_job(&self, id: &str) -> Result<(), StoreError>;
    fn load_schedules(&self) -> Result<Vec<ScheduleRecord>, StoreError>;
    fn put_schedule(&self, record: &ScheduleRecord) -> Result<(), StoreError>;
    fn delete_schedule(&self, id: &str) -> Result<(), StoreError>;
    /// A job a schedule fired and the schedule advanced past that time, in one write where the
    /// store can (etcd: one transaction), so a fired time is never lost nor fired twice across
    /// a failover. By default: the job, then the schedule.
    fn put_job_and_schedule(&self, job: &JobRecord, schedule: &ScheduleRecord) -> Result<(), StoreError> {
        self.put_job(job)?;
        self.put_schedule(schedule)
    }
    /// Registered workers, for a new leader (etcd). A single master keeps membership as soft
    /// state (workers register again after a restart): by default nothing is kept.
    fn load_workers(&self) -> Result<Vec<WorkerEntry>, StoreError> {
        Ok(Vec::new())
    }
    fn put_worker(&self, _entry: &WorkerEntry) -> Result<(), StoreError> {
        Ok(())
    }
    fn delete_worker(&self, _id: &str) -> Result<(), StoreError> {
        Ok(())
    }
    /// Tokens created with `strata token create` (hashes, roles, scopes; never a token).
    fn load_tokens(&self) -> Result<Vec<TokenRecord>, StoreError>;
    fn put_token(&self, record: &TokenRecord) -> Result<(), StoreError>;
    fn delete_token(&self, id: &str) -> Result<(), StoreError>;
    /// Write-back files acknowledged and not yet in the UFS, by path.
    fn load_pending(&self) -> Result<Vec<PendingRecord>, StoreError>;
    fn put_pending(&self, record: &PendingRecord) -> Result<(), StoreError>;
    fn delete_pending(&self, path: &str) -> Result<(), StoreError>;

    fn load_pins(&self) -> Result<Vec<PinRecord>, StoreError>;
    fn put_pin(&self, record: &PinRecord) -> Result<(), StoreError>;
    fn delete_pin(&self, path: &str) -> Result<(), StoreError>;
    fn load_cache_ttls(&self) -> Result<Vec<CacheTtlRecord>, StoreError>;
    fn put_cache_ttl(&self, record: &CacheTtlRecord) -> Result<(), StoreError>;
    fn delete_cache_ttl(&self, path: &str) -> Result<(), StoreError>;
    /// Lineage records and marks (see `lineage`), keyed by their `store_key`.
    fn load_lineage(&self) -> Result<(Vec<LineageRecord>, Vec<MarkRecord>), StoreError>;
    /// Records and marks written in one transaction (etcd: in transactions of at most 100
    /// writes, each applied whole).
    fn put_lineage(&self, records: &[LineageRecord], marks: &[MarkRecord]) -> Result<(), StoreError>;
    fn delete_lineage(&self, record_keys: &[String], mark_keys: &[String]) -> Result<(), StoreError>;
    /// Releases the underlying file so a new master in this process can open it.
    fn close(&self);
}

pub struct RedbStore {
    db: Mutex<Option<Database>>,
}

impl RedbStore {
    pub fn open(path: &Path) -> Result<Self, StoreError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(db_err)?;
        }
        let db = Database::create(path).map_err(db_err)?;
        let txn = db.begin_write().map_err(db_err)?;
        txn.open_table(MOUNTS).map_err(db_err)?;
        txn.open_table(JOBS).map_err(db_err)?;
        txn.open_table(SCHEDULES).map_err(db_err)?;
        txn.open_table(TOKENS).map_err(db_err)?;
        txn.open_table(PENDING).map_err(db_err)?;
        txn.open_table(PINS).map_err(db_err)?;
        txn.open_table(CACHE_TTLS).map_err(db_err)?;
        txn.open_table(LINEAGE).map_err(db_err)?;
        txn.open_table(LINEAGE_MARKS).map_err(db_err)?;
        txn.commit().map_err(db_err)?;
        Ok(Self { db: Mutex::new(Some(db)) })
    }

    fn with_db<T>(&self, f: impl FnOnce(&Database) -> Result<T, StoreError>) -> Result<T, StoreError> {
        let guard = self.db.lock().unwrap_or_else(|p| p.into_inner());
        f(guard.as_ref().ok_or(StoreError::Closed)?)
    }
}

impl RedbStore {
    fn load_all<T: serde::de::DeserializeOwned>(
        &self,
        def: TableDefinition<&str, &str>,
    ) -> Result<Vec<T>, StoreError> {
        self.with_db(|db| {
            let txn = db.begin_read().map_err(db_err)?;
            let table = txn.open_table(def).map_err(db_err)?;
            let mut out = Vec::new();
            for row in table.iter().map_err(db_err)? {
                let (k, v) = row.map_err(db_err)?;
                let record = serde_json::from_str(v.value())
                    .map_err(|e| StoreError::Corrupt { key: k.value().to_string(), reason: e.to_string() })?;
                out.push(record);
            }
            Ok(out)
        })
    }

    fn put(
        &self,
        def: TableDefinition<&str, &str>,
        key: &str,
        record: &impl serde::Serialize,
    ) -> Result<(), StoreError> {
        let value = serde_json::to_string(record).map_err(db_err)?;
        self.with_db(|db| {
            let txn = db.begin_write().map_err(db_err)?;
            txn.open_table(def).map_err(db_err)?.insert(key, value.as_str()).map_err(db_err)?;
            txn.commit().map_err(db_err)
        })
    }

    fn delete(&self, def: TableDefinition<&str, &str>, key: &str) -> Result<(), StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write().map_err(db_err)?;
            txn.open_table(def).map_err(db_err)?.remove(key).map_err(db_err)?;
            txn.commit().map_err(db_err)
        })
    }
}

impl MetaStore for RedbStore {
    fn load_mounts(&self) -> Result<Vec<MountRecord>, StoreError> {
        self.load_all(MOUNTS)
    }

    fn put_mount(&self, record: &MountRecord) -> Result<(), StoreError> {
        self.put(MOUNTS, &record.path, record)
    }

    fn delete_mount(&self, path: &str) -> Result<(), StoreError> {
        self.delete(MOUNTS, path)
    }

    fn load_jobs(&self) -> Result<Vec<JobRecord>, StoreError> {
        self.load_all(JOBS)
    }

    fn put_job(&self, record: &JobRecord) -> Result<(), StoreError> {
        self.put(JOBS, &record.id, record)
    }

    fn delete_job(&self, id: &str) -> Result<(), StoreError> {
        self.delete(JOBS, id)
    }

    fn load_schedules(&self) -> Result<Vec<ScheduleRecord>, StoreError> {
        self.load_all(SCHEDULES)
    }

    fn put_schedule(&self, record: &ScheduleRecord) -> Result<(), StoreError> {
        self.put(SCHEDULES, &record.id, record)
    }

    fn delete_schedule(&self, id: &str) -> Result<(), StoreError> {
        self.delete(SCHEDULES, id)
    }

    fn put_job_and_schedule(&self, job: &JobRecord, schedule: &ScheduleRecord) -> Result<(), StoreError> {
        let job_value = serde_json::to_string(job).map_err(db_err)?;
        let schedule_value = serde_json::to_string(schedule).map_err(db_err)?;
        self.with_db(|db| {
            let txn = db.begin_write().map_err(db_err)?;
            txn.open_table(JOBS)
                .map_err(db_err)?
                .insert(job.id.as_str(), job_value.as_str())
                .map_err(db_err)?;
            txn.open_table(SCHEDULES)
                .map_err(db_err)?
                .insert(schedule.id.as_str(), schedule_value.as_str())
                .map_err(db_err)?;
            txn.commit().map_err(db_err)
        })
    }

    fn load_tokens(&self) -> Result<Vec<TokenRecord>, StoreError> {
        self.load_all(TOKENS)
    }

    fn put_token(&self, record: &TokenRecord) -> Result<(), StoreError> {
        self.put(TOKENS, &record.id, record)
    }

    fn delete_token(&self, id: &str) -> Result<(), StoreError> {
        self.delete(TOKENS, id)
    }

    fn load_pending(&self) -> Result<Vec<PendingRecord>, StoreError> {
        self.load_all(PENDING)
    }

    fn put_pending(&self, record: &PendingRecord) -> Result<(), StoreError> {
        self.put(PENDING, &record.path, record)
    }

    fn delete_pending(&self, path: &str) -> Result<(), StoreError> {
        self.delete(PENDING, path)
    }

    fn load_pins(&self) -> Result<Vec<PinRecord>, StoreError> {
        self.load_all(PINS)
    }

    fn put_pin(&self, record: &PinRecord) -> Result<(), StoreError> {
        self.put(PINS, &record.path, record)
    }

    fn delete_pin(&self, path: &str) -> Result<(), StoreError> {
        self.delete(PINS, path)
    }

    fn load_cache_ttls(&self) -> Result<Vec<CacheTtlRecord>, StoreError> {
        self.load_all(CACHE_TTLS)
    }

    fn put_cache_ttl(&self, record: &CacheTtlRecord) -> Result<(), StoreError> {
        self.put(CACHE_TTLS, &record.path, record)
    }

    fn delete_cache_ttl(&self, path: &str) -> Result<(), StoreError> {
        self.delete(CACHE_TTLS, path)
    }

    fn load_lineage(&self) -> Result<(Vec<LineageRecord>, Vec<MarkRecord>), StoreError> {
        Ok((self.load_all(LINEAGE)?, self.load_all(LINEAGE_MARKS)?))
    }

    fn put_lineage(&self, records: &[LineageRecord], marks: &[MarkRecord]) -> Result<(), StoreError> {
        let mut rows = Vec::with_capacity(records.len());
        for r in records {
            rows.push((r.store_key(), serde_json::to_string(r).map_err(db_err)?));
        }
        let mut mark_rows = Vec::with_capacity(marks.len());
        for m in marks {
            mark_rows.push((m.store_key(), serde_json::to_string(m).map_err(db_err)?));
        }
        self.with_db(|db| {
            let txn = db.begin_write().map_err(db_err)?;
            {
                let mut table = txn.open_table(LINEAGE).map_err(db_err)?;
                for (k, v) in &rows {
                    table.insert(k.as_str(), v.as_str()).map_err(db_err)?;
                }
                let mut table = txn.open_table(LINEAGE_MARKS).map_err(db_err)?;
                for (k, v) in &mark_rows {
                    table.insert(k.as_str(), v.as_str()).map_err(db_err)?;
                }
            }
            txn.commit().map_err(db_err)
        })
    }

    fn delete_lineage(&self, record_keys: &[String], mark_keys: &[String]) -> Result<(), StoreError> {
        self.with_db(|db| {
            let txn = db.begin_write().map_err(db_err)?;
            {
                let mut table = txn.open_table(LINEAGE).map_err(db_err)?;
                for k in record_keys {
                    table.remove(k.as_str()).map_err(db_err)?;
                }
                let mut table = txn.open_table(LINEAGE_MARKS).map_err(db_err)?;
                for k in mark_keys {
                    table.remove(k.as_str()).map_err(db_err)?;
                }
            }
            txn.commit().map_err(db_err)
        })
    }

    fn close(&self) {
        self.db.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

/// An in-memory store for unit tests, keeping only workers, whose writes fail with
/// [`StoreError::NotLeader`] while `deposed` is set (a leader that lost its term).
#[cfg(test)]
#[derive(Default)]
pub(crate) struct MemStore {
    pub workers: Mutex<std::collections::BTreeMap<String, WorkerEntry>>,
    pub pending: Mutex<std::collections::BTreeMap<String, PendingRecord>>,
    pub pins: Mutex<std::collections::BTreeMap<String, PinRecord>>,
    pub cache_ttls: Mutex<std::collections::BTreeMap<String, CacheTtlRecord>>,
    pub deposed: std::sync::atomic::AtomicBool,
}

#[cfg(test)]
impl MemStore {
    fn write(&self) -> Result<(), StoreError> {
        if self.deposed.load(std::sync::atomic::Ordering::SeqCst) {
            Err(StoreError::NotLeader)
        } else {
            Ok(())
        }
    }
}

#[cfg(test)]
impl MetaStore for MemStore {
    fn load_mounts(&self) -> Result<Vec<MountRecord>, StoreError> {
        Ok(Vec::new())
    }
    fn put_mount(&self, _: &MountRecord) -> Result<(), StoreError> {
        self.write()
    }
    fn delete_mount(&self, _: &str) -> Result<(), StoreError> {
        self.write()
    }
    fn load_jobs(&self) -> Result<Vec<JobRecord>, StoreError> {
        Ok(Vec::new())
    }
    fn put_job(&self, _: &JobRecord) -> Result<(), StoreError> {
        self.write()
    }
    fn delete_job(&self, _: &str) -> Result<(), StoreError> {
        self.write()
    }
    fn load_schedules(&self) -> Result<Vec<ScheduleRecord>, StoreError> {
        Ok(Vec::new())
    }
    fn put_schedule(&self, _: &ScheduleRecord) -> Result<(), StoreError> {
        self.write()
    }
    fn delete_schedule(&self, _: &str) -> Result<(), StoreError> {
        self.write()
    }
    fn load_workers(&self) -> Result<Vec<WorkerEntry>, StoreError> {
        Ok(self.workers.lock().unwrap().values().cloned().collect())
    }
    fn put_worker(&self, entry: &WorkerEntry) -> Result<(), StoreError> {
        self.write()?;
        self.workers.lock().unwrap().insert(entry.id.clone(), entry.clone());
        Ok(())
    }
    fn delete_worker(&self, id: &str) -> Result<(), StoreError> {
        self.write()?;
        self.workers.lock().unwrap().remove(id);
        Ok(())
    }
    fn load_tokens(&self) -> Result<Vec<TokenRecord>, StoreError> {
        Ok(Vec::new())
    }
    fn put_token(&self, _: &TokenRecord) -> Result<(), StoreError> {
        self.write()
    }
    fn delete_token(&self, _: &str) -> Result<(), StoreError> {
        self.write()
    }
    fn load_pending(&self) -> Result<Vec<PendingRecord>, StoreError> {
        Ok(self.pending.lock().unwrap().values().cloned().collect())
    }
    fn put_pending(&self, record: &PendingRecord) -> Result<(), StoreError> {
        self.write()?;
        self.pending.lock().unwrap().insert(record.path.clone(), record.clone());
        Ok(())
    }
    fn delete_pending(&self, path: &str) -> Result<(), StoreError> {
        self.write()?;
        self.pending.lock().unwrap().remove(path);
        Ok(())
    }
    fn load_pins(&self) -> Result<Vec<PinRecord>, StoreError> {
        Ok(self.pins.lock().unwrap().values().cloned().collect())
    }
    fn put_pin(&self, record: &PinRecord) -> Result<(), StoreError> {
        self.write()?;
        self.pins.lock().unwrap().insert(record.path.clone(), record.clone());
        Ok(())
    }
    fn delete_pin(&self, path: &str) -> Result<(), StoreError> {
        self.write()?;
        self.pins.lock().unwrap().remove(path);
        Ok(())
    }
    fn load_cache_ttls(&self) -> Result<Vec<CacheTtlRecord>, StoreError> {
        Ok(self.cache_ttls.lock().unwrap().values().cloned().collect())
    }
    fn put_cache_ttl(&self, record: &CacheTtlRecord) -> Result<(), StoreError> {
        self.write()?;
        self.cache_ttls.lock().unwrap().insert(record.path.clone(), record.clone());
        Ok(())
    }
    fn delete_cache_ttl(&self, path: &str) -> Result<(), StoreError> {
        self.write()?;
        self.cache_ttls.lock().unwrap().remove(path);
        Ok(())
    }
    fn load_lineage(&self) -> Result<(Vec<LineageRecord>, Vec<MarkRecord>), StoreError> {
        Ok((Vec::new(), Vec::new()))
    }
    fn put_lineage(&self, _: &[LineageRecord], _: &[MarkRecord]) -> Result<(), StoreError> {
        self.write()
    }
    fn delete_lineage(&self, _: &[String], _: &[String]) -> Result<(), StoreError> {
        self.write()
    }
    fn close(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("master.redb");
        let record = MountRecord {
            path: "/data".into(),
            uri: "file:///tmp".into(),
            options: [("metadata_ttl".to_string(), "1s".to_string())].into(),
        };
        {
            let store = RedbStore::open(&path).unwrap();
            store.put_mount(&record).unwrap();
            store.put_mount(&MountRecord { path: "/gone".into(), ..record.clone() }).unwrap();
            store.delete_mount("/gone").unwrap();
            store.close();
            assert!(matches!(store.load_mounts(), Err(StoreError::Closed)));
        }
        let store = RedbStore::open(&path).unwrap();
        assert_eq!(store.load_mounts().unwrap(), vec![record]);
    }

    #[test]
    fn jobs_and_schedules_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("master.redb");
        let job = JobRecord {
            id: "j1".into(),
            path: "/data".into(),
            cursor: Some("a/b".into()),
            ..Default::default()
        };
        let sched = ScheduleRecord {
            id: "s1".into(),
            cron: "0 1 * * *".into(),
            tz: "UTC".into(),
            path: "/data".into(),
            settings: Default::default(),
            next_fire_ms: 5,
            last_job_id: "j1".into(),
            fired: 1,
            skipped: 0,
            created_ms: 1,
        };
        {
            let store = RedbStore::open(&path).unwrap();
            store.put_job(&job).unwrap();
            store.put_schedule(&sched).unwrap();
            store.put_schedule(&ScheduleRecord { id: "s2".into(), ..sched.clone() }).unwrap();
            store.delete_schedule("s2").unwrap();
            store.close();
        }
        let store = RedbStore::open(&path).unwrap();
        assert_eq!(store.load_jobs().unwrap(), vec![job]);
        assert_eq!(store.load_schedules().unwrap(), vec![sched]);
    }

    #[test]
    fn tokens_survive_reopen_and_revoke() {
        use strata_security::token::{Role, TokenRecord, generate};
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("master.redb");
        let kept = TokenRecord::new(&generate(), Role::Reader, Some("/a"), "team a", 5).unwrap();
        let revoked = TokenRecord::new(&generate(), Role::Writer, None, "", 6).unwrap();
        {
            let store = RedbStore::open(&path).unwrap();
            store.put_token(&kept).unwrap();
            store.put_token(&revoked).unwrap();
            store.delete_token(&revoked.id).unwrap();
            store.close();
        }
        let store = RedbStore::open(&path).unwrap();
        assert_eq!(store.load_tokens().unwrap(), vec![kept]);
    }
}
