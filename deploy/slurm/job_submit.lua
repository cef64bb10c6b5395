--[[
nodeshare: hold every job at submission, so that the placement adapter (`nodeshare slurm
scheduler`) places and releases it (docs/deployment.md, "Placement decisions that act").

Install: copy to the directory of slurm.conf as job_submit.lua, set JobSubmitPlugins=lua in
slurm.conf, then `scontrol reconfigure`.

Bypass: a job submitted with a QOS named in BYPASS_QOS is not held, and Slurm schedules it as
usual: urgent work, or every job while nodeshare's adapter is down (`sbatch --qos=nodeshare-bypass`).
Create the QOS (`sacctmgr add qos nodeshare-bypass`) and give it to the users allowed to bypass
(`sacctmgr modify user U set qos+=nodeshare-bypass`); Slurm refuses a QOS a user may not use.
Without slurmdbd (AccountingStorageType=accounting_storage/none) Slurm checks no QOS, so any user
can bypass: add names to BYPASS_USERS instead, or run slurmdbd.

A held job is `priority = 0` (squeue's reason: JobHeldUser); the adapter releases only that hold.
]]

local BYPASS_QOS = { ["nodeshare-bypass"] = true }
local BYPASS_USERS = {}  -- uid -> true: e.g. { [0] = true } lets root's jobs run unheld

function slurm_job_submit(job_desc, part_list, submit_uid)
    if job_desc.qos ~= nil and BYPASS_QOS[job_desc.qos] then
        slurm.log_info("nodeshare: job %s of uid %u not held (QOS %s)", tostring(job_desc.name), submit_uid,
                       job_desc.qos)
        return slurm.SUCCESS
    end
    if BYPASS_USERS[submit_uid] then
        return slurm.SUCCESS
    end
    job_desc.priority = 0
    return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
    return slurm.SUCCESS
end

return slurm.SUCCESS
