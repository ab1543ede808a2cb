-- Argo CD health check for shoal.dev/InferenceDeployment.
--
-- Argo CD runs it with the live object in `obj` and reads back {status, message}.
-- The rules, first match wins (docs/gitops.md):
--   no status yet, or status.observedGeneration behind metadata.generation
--       -> Progressing  (the operator has not acted on the latest spec; an old
--                        Degraded condition says nothing about the new one)
--   condition Degraded=True                                   -> Degraded
--   Available=True and Progressing reason PartitionReached
--   (rollout.partition holds older groups: a staged rollout) -> Suspended
--   Available=True and updatedReplicas == replicas (and every
--   condition written for the current generation)             -> Healthy
--   anything else (a rollout under way, groups loading)       -> Progressing
-- The copy inside argocd-cm.yaml is generated from this file by gen_argocd_cm.py.

local hs = {}

local function condition(status, kind)
  if status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

local function stale(c, generation)
  return c ~= nil and c.observedGeneration ~= nil and generation ~= nil and c.observedGeneration < generation
end

-- Numbers print as "2" both in Argo CD's gopher-lua and in Lua 5.4 (where 2.0 would
-- print "2.0"); string.format("%d") differs between the two.
local function int(x)
  return tostring(math.floor(x))
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  local text = c.message
  if text == nil or text == "" then
    text = c.reason
  end
  if text == nil or text == "" then
    return fallback
  end
  return text
end

local status = obj.status
local generation = obj.metadata and obj.metadata.generation or nil

if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end

local observed = status.observedGeneration
if observed == nil or (generation ~= nil and observed < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. (generation and int(generation) or "?")
  return hs
end

local degraded = condition(status, "Degraded")
if degraded ~= nil and degraded.status == "True" and not stale(degraded, generation) then
  hs.status = "Degraded"
  hs.message = describe(degraded, "InferenceDeployment is degraded")
  return hs
end

local available = condition(status, "Available")
local progressing = condition(status, "Progressing")
local replicas = status.replicas or 0
local updated = status.updatedReplicas or 0
local ready = status.readyReplicas or 0

if available ~= nil and available.status == "True" and not stale(available, generation)
    and progressing ~= nil and progressing.reason == "PartitionReached" and not stale(progressing, generation) then
  hs.status = "Suspended"
  hs.message = describe(progressing, "Staged rollout held by rollout.partition")
  return hs
end

if available ~= nil and available.status == "True" and not stale(available, generation)
    and updated == replicas then
  hs.status = "Healthy"
  hs.message = int(ready) .. "/" .. int(replicas) .. " groups ready at the current revision"
  return hs
end

hs.status = "Progressing"
if updated ~= replicas then
  hs.message = "Rolling out: " .. int(updated) .. " of " .. int(replicas) .. " groups updated, " .. int(ready) .. " ready"
elseif available == nil or available.status ~= "True" then
  hs.message = describe(available, "Waiting for groups to become available")
else
  hs.message = describe(progressing, "Waiting for the operator to confirm the current generation")
end
return hs
