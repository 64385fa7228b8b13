//! Load jobs (warmup) and their schedules, as the master runs them. Thin wrappers over the
//! control-plane RPCs; the master validates (unknown path, bad glob, bad cron, more replicas
//! than live workers) and its errors come back as `ClientError`s with their kinds.

use strata_proto::{
    Empty, JobId, JobInfo, JobState, ListJobsRequest, LoadOptions, ScheduleId, ScheduleInfo, ScheduleRequest,
    SubmitLoadRequest,
};

use crate::{AdminClient, Result};

/// Whether a job has reached SUCCEEDED, FAILED or CANCELLED.
pub fn job_finished(job: &JobInfo) -> bool {
    matches!(job.state(), JobState::Succeeded | JobState::Failed | JobState::Cancelled)
}

impl AdminClient {
    /// Submits a load job of a file or a directory tree; returns at once with its id.
    pub async fn submit_load(&self, path: &str, options: LoadOptions) -> Result<JobInfo> {
        let req = SubmitLoadRequest { path: path.to_string(), options: Some(options) };
        Ok(self.master().submit_load(req).await.map_err(self.rpc_err("submit_load"))?.into_inner())
    }

    pub async fn job_status(&self, id: &str) -> Result<JobInfo> {
        let req = JobId { id: id.to_string() };
        Ok(self.master().get_job(req).await.map_err(self.rpc_err("get_job"))?.into_inner())
    }

    /// Running jobs, or with `finished` every job the master knows (newest first).
    pub async fn list_jobs(&self, finished: bool, limit: u32) -> Result<Vec<JobInfo>> {
        let req = ListJobsRequest { finished, limit };
        Ok(self.master().list_jobs(req).await.map_err(self.rpc_err("list_jobs"))?.into_inner().jobs)
    }

    pub async fn cancel_job(&self, id: &str) -> Result<JobInfo> {
        let req = JobId { id: id.to_string() };
        Ok(self.master().cancel_job(req).await.map_err(self.rpc_err("cancel_job"))?.into_inner())
    }

    /// Polls a job every `every` until it ends, calling `on_progress` with each snapshot.
    pub async fn wait_job(
        &self,
        id: &str,
        every: std::time::Duration,
        mut on_progress: impl FnMut(&JobInfo),
    ) -> Result<JobInfo> {
        loop {
            let job = self.job_status(id).await?;
            on_progress(&job);
            if job_finished(&job) {
                return Ok(job);
            }
            tokio::time::sleep(every).await;
        }
    }

    /// Stores a schedule that submits a load job of `path` at each time of `cron` (5 fields,
    /// or 6 with leading seconds) in time zone `tz` (IANA name; empty = UTC).
    pub async fn add_schedule(
        &self,
        cron: &str,
        tz: &str,
        path: &str,
        options: LoadOptions,
    ) -> Result<ScheduleInfo> {
        let req = ScheduleRequest {
            cron: cron.to_string(),
            tz: tz.to_string(),
            path: path.to_string(),
            options: Some(options),
        };
        Ok(self.master().add_schedule(req).await.map_err(self.rpc_err("add_schedule"))?.into_inner())
    }

    pub async fn list_schedules(&self) -> Result<Vec<ScheduleInfo>> {
        Ok(self
            .master()
            .list_schedules(Empty {})
            .await
            .map_err(self.rpc_err("list_schedules"))?
            .into_inner()
            .schedules)
    }

    pub async fn remove_schedule(&self, id: &str) -> Result<()> {
        let req = ScheduleId { id: id.to_string() };
        self.master().remove_schedule(req).await.map_err(self.rpc_err("remove_schedule"))?;
        Ok(())
    }
}
